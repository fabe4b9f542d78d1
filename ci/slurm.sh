#!/usr/bin/env bash
# The tests' own one-node SLURM cluster: a private slurmctld, slurmd and munged that share nothing
# with a system SLURM on the same machine. tests/conftest.py (fixture slurm_cluster) starts it for
# the SLURM tests; start it by hand to try the SLURM profile.
#
#   ci/slurm.sh up     start it, or reuse it when it already runs and answers; prints SLURM_CONF=...
#                      and STARTED=yes|no on stdout (progress goes to stderr)
#   ci/slurm.sh down   cancel its jobs and stop its three daemons
#   ci/slurm.sh env    print `export SLURM_CONF=...`: eval "$(ci/slurm.sh env)"; sinfo
#
# Everything lives in one private directory, EAGLENEST_SLURM_DIR (default /tmp/eaglenest-slurm-<hash of
# this checkout's path>, one cluster per checkout): etc/slurm.conf (from ci/slurm.conf), state/, spool/,
# log/, run/ (the daemons' pidfiles) and munge/ (its own key, socket, pidfile and seed). The ports are
# the first free pair from 16817 (not SLURM's 6817/6818). Nothing under /etc is written, the caller's
# SLURM_CONF is ignored, and the only processes ever signalled are those whose pid is in a pidfile of
# that directory and whose name is the daemon's.
#
# slurmd, and so every job, runs in a mount namespace of its own in which /etc/slurm is the private
# etc/ (a bind mount no other process sees): a job's SLURM command that has lost SLURM_CONF finds
# this cluster's configuration at SLURM's default path, never a system cluster's. One such command
# is the nested srun of Snakemake's SLURM executor, whose jobstep plugin drops SLURM_CONF.
#
# Needs root (slurmd runs jobs as their users; the mount namespace) and Debian's slurm-wlm and munge,
# which `up` installs when missing (installing configures and starts nothing here). Exits 77 with the
# reason when this machine cannot run it (not root; packages missing and no apt-get; no mount
# namespace): the tests skip then. Other failures exit 1 with the reason and the daemons' log tails.
# SLURM_UP_TIMEOUT=seconds to wait for the node (default 60).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
TEMPLATE="$HERE/slurm.conf"
DIR="${EAGLENEST_SLURM_DIR:-/tmp/eaglenest-slurm-$(printf %s "$(dirname "$HERE")" | sha1sum | cut -c1-8)}"
CONF="$DIR/etc/slurm.conf"
SOCKET="$DIR/munge/munge.socket"
TIMEOUT="${SLURM_UP_TIMEOUT:-60}"
FIRST_PORT=16817
export SLURM_CONF="$CONF"  # every SLURM command below talks to this cluster, whatever the caller's says

say() { echo "slurm.sh: $*" >&2; }

cannot() { # this machine cannot run the cluster: the tests skip with this reason
    echo "slurm.sh: cannot start the tests' SLURM cluster: $*" >&2
    exit 77
}

fail() {
    echo "slurm.sh: FAILED: $*" >&2
    for f in "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" "$DIR/log/munged.log"; do
        [[ -f $f ]] && { echo "--- last lines of $f" >&2; tail -n 25 "$f" >&2; }
    done
    [[ -f $CONF ]] && command -v sinfo >/dev/null && { echo "--- sinfo -R" >&2; sinfo -R >&2 || true; }
    exit 1
}

alive() { # alive PID: the process runs (a zombie does not: a daemon's parent is init, which may reap it late)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    [[ ${stat##*) } != Z* ]]
}

pid_of() { # pid_of PIDFILE NAME: the pid in PIDFILE if that process runs and is named NAME
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] && alive "$pid" && echo "$pid"
}

# The cluster's three daemons: name and pidfile.
DAEMONS=(munged:"$DIR/munge/munged.pid" slurmctld:"$DIR/run/slurmctld.pid" slurmd:"$DIR/run/slurmd.pid")

running() { # running NAME
    local d
    for d in "${DAEMONS[@]}"; do
        [[ ${d%%:*} == "$1" ]] && { pid_of "${d#*:}" "$1" >/dev/null; return; }
    done
    return 1
}

stop_daemon() { # stop_daemon NAME: TERM, then KILL after 10 s
    local d pid
    for d in "${DAEMONS[@]}"; do
        [[ ${d%%:*} == "$1" ]] || continue
        pid=$(pid_of "${d#*:}" "$1") || return 0
        say "stopping $1 ($pid)"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do alive "$pid" || return 0; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
}

munge_works() {
    munge --socket="$SOCKET" -n </dev/null 2>/dev/null | unmunge --socket="$SOCKET" >/dev/null 2>&1
}

node_state() {
    sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1 || true
}

listening() { # listening PORT: a socket of this machine listens on PORT (any address)
    awk -v p="$(printf ':%04X' "$1")" '$4 == "0A" && substr($2, length($2) - 4) == p {f = 1} END {exit !f}' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

conf_port() { # conf_port KEY: the port KEY names in the current slurm.conf
    sed -n "s/^$1=\([0-9]*\)$/\1/p" "$CONF" 2>/dev/null
}

render_conf() { # render_conf CTLD_PORT SLURMD_PORT: slurm.conf sized to this machine
    # slurmd registers only under its own short hostname and with no more CPUs or memory than it
    # finds, so take both from `slurmd -C` (what slurmd will report).
    local node cpus mem
    node=$(slurmd -C 2>/dev/null | head -n 1 || true)
    cpus=$(sed -n 's/.*\bCPUs=\([0-9]*\).*/\1/p' <<<"$node")
    mem=$(sed -n 's/.*\bRealMemory=\([0-9]*\).*/\1/p' <<<"$node")
    [[ -n $cpus ]] || cpus=$(nproc)
    [[ -n $mem ]] || mem=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    mem=$((mem * 95 / 100))  # headroom: memory reported at registration may dip a little below this boot's total
    sed -e "s|@HOST@|$HOST|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEM_MB@|$mem|g" -e "s|@DIR@|$DIR|g" \
        -e "s|@CTLD_PORT@|$1|g" -e "s|@SLURMD_PORT@|$2|g" "$TEMPLATE"
}

pick_ports() { # pick_ports: "CTLD SLURMD", the ports of the last start when free again, else the first free pair
    local p=$(conf_port SlurmctldPort)
    if [[ -n $p ]] && ! listening "$p" && ! listening "$((p + 1))"; then echo "$p $((p + 1))"; return; fi
    for ((p = FIRST_PORT; p < FIRST_PORT + 200; p += 2)); do
        listening "$p" || listening "$((p + 1))" || { echo "$p $((p + 1))"; return; }
    done
    fail "no two free ports between $FIRST_PORT and $((FIRST_PORT + 200))"
}

private_dir() { # the directory exists, is ours and only we can write it (root daemons read their config there)
    [[ -L $DIR ]] && fail "$DIR is a symbolic link; remove it or set EAGLENEST_SLURM_DIR"
    mkdir -p -m 755 "$DIR"
    [[ $(stat -c %u "$DIR") == "$(id -u)" ]] || fail "$DIR belongs to another user; remove it or set EAGLENEST_SLURM_DIR"
    (( (8#$(stat -c %a "$DIR") & 8#022) == 0 )) || fail "$DIR is writable by others; remove it or set EAGLENEST_SLURM_DIR"
    mkdir -p -m 755 "$DIR/etc" "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run" "$DIR/munge"
}

down() {
    if running slurmctld; then  # its jobs first: a stopped slurmd would leave their processes behind
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling jobs $(tr '\n' ' ' <<<"$jobs")"
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 30); do [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break; sleep 1; done
        fi
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon munged
}

up() {
    local t0=$SECONDS
    [[ $(id -u) == 0 ]] || cannot "it needs root (slurmd runs jobs as their users); run as root, as CI does"
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
            || ! command -v munged >/dev/null; then
        command -v apt-get >/dev/null || cannot "slurm-wlm and munge are not installed, and there is no apt-get to install them"
        say "installing slurm-wlm and munge"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq || fail "apt-get update failed"
        apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null || fail "apt-get install slurm-wlm munge failed"
    fi
    [[ -d /etc/slurm ]] && unshare --mount --propagation private true 2>/dev/null \
        || cannot "slurmd needs a mount namespace with /etc/slurm in it (unshare --mount failed or /etc/slurm is missing)"
    HOST=$(hostname -s)
    private_dir

    # Reuse: all three daemons up, the configuration unchanged, munge and the node answering.
    if running munged && running slurmctld && running slurmd \
            && [[ "$(render_conf "$(conf_port SlurmctldPort)" "$(conf_port SlurmdPort)")" == "$(cat "$CONF")" ]] \
            && munge_works && [[ $(node_state) =~ ^(idle|mixed|allocated|completing)$ ]]; then
        say "reusing the cluster that runs in $DIR (node $HOST $(node_state))"
        echo "SLURM_CONF=$CONF"
        echo "STARTED=no"
        return
    fi
    down  # whatever of ours is left from an earlier start (never another's daemon: see stop_daemon)

    # Munge: its own key (kept across starts) and socket.
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge/munge.key" status=none
    fi
    chmod 400 "$DIR/munge/munge.key"
    say "starting munged (socket $SOCKET)"
    munged --socket="$SOCKET" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --seed-file="$DIR/munge/munged.seed" --log-file="$DIR/log/munged.log" || fail "munged did not start"
    munge_works || fail "munge cannot encode and decode a credential on $SOCKET"

    # slurm.conf, then the SLURM daemons from a clean state (jobs of an earlier start were cancelled).
    local ports
    ports=($(pick_ports)) || exit 1
    render_conf "${ports[0]}" "${ports[1]}" >"$CONF"
    say "starting slurmctld (port ${ports[0]}) and slurmd (port ${ports[1]}) with $CONF"
    slurmctld -f "$CONF" -c || fail "slurmctld did not start"
    # shellcheck disable=SC2016  # $1 and $2 are the inner shell's
    unshare --mount --propagation private -- sh -c 'mount --bind "$1" /etc/slurm && exec slurmd -f "$2"' \
        slurmd-in-namespace "$DIR/etc" "$CONF" || fail "slurmd did not start (in its mount namespace)"

    # Wait until the node is idle (or busy with jobs); resume it when it is down or drained.
    local deadline=$((SECONDS + TIMEOUT)) state=""
    while :; do
        state=$(node_state)
        case $state in
            idle|mixed|allocated|completing) break ;;
            down*|drain*|drained*|fail*)
                scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
        esac
        ((SECONDS < deadline)) || fail "node $HOST is '${state:-not listed}' after ${TIMEOUT}s: $(scontrol show node "$HOST" 2>&1 | grep -o 'Reason=.*' || true)"
        sleep 0.5
    done

    # A job runs end to end (controller -> slurmd -> process and back).
    timeout 60 srun --quiet -N1 -n1 -t 1 true || fail "srun of a trivial job failed on node $HOST ($state)"
    # srun returns before the controller has seen the job's end: the node stays 'completing' a moment
    # (one CI run's sinfo saw it). A fresh cluster is handed over idle, so the first job need not wait.
    deadline=$((SECONDS + 30))
    while state=$(node_state); [[ $state == completing ]] && ((SECONDS < deadline)); do sleep 0.2; done
    say "cluster up in $DIR: node $HOST $state, partition $(sinfo -h -o %P | head -n 1), $((SECONDS - t0)) s"
    echo "SLURM_CONF=$CONF"
    echo "STARTED=yes"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
