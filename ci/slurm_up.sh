#!/usr/bin/env bash
# Start (or check) a one-node SLURM cluster on this machine, for tests/test_slurm.py and for trying
# the SLURM profile by hand. Idempotent: installs Debian's slurm-wlm and munge if missing, writes the
# munge key and /etc/slurm/slurm.conf (from ci/slurm.conf, sized to this machine), starts munged,
# slurmctld and slurmd if they are not running, and waits until the node is idle.
# Exits non-zero with the reason and the daemons' log tails when the cluster does not come up.
# Needs root. Usage: ci/slurm_up.sh   (SLURM_UP_TIMEOUT=seconds to wait for the node, default 60)
set -euo pipefail

TEMPLATE="$(cd "$(dirname "$0")" && pwd)/slurm.conf"
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
TIMEOUT="${SLURM_UP_TIMEOUT:-60}"
T0=$SECONDS

say() { echo "slurm_up: $*"; }

fail() {
    echo "slurm_up: FAILED: $*" >&2
    for f in "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" /var/log/munge/munged.log; do
        [[ -f $f ]] && { echo "--- last lines of $f" >&2; tail -n 25 "$f" >&2; }
    done
    command -v sinfo >/dev/null && { echo "--- sinfo -R" >&2; sinfo -R >&2 || true; }
    exit 1
}

running() { # running PIDFILE NAME: is the daemon whose pid is in PIDFILE alive (and named NAME)?
    [[ -s $1 ]] && [[ "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" == "$2" ]]
}

[[ $(id -u) == 0 ]] || fail "run as root (it installs packages and starts system daemons)"

# 1. Packages.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || fail "apt-get update failed"
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null || fail "apt-get install slurm-wlm munge failed"
fi

mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGDIR"

# 2. Munge: a key (kept if present), then the daemon.
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
if ! running /run/munge/munged.pid munged; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
fi
munge -n </dev/null | unmunge >/dev/null 2>&1 || fail "munge cannot encode and decode a credential"

# 3. slurm.conf sized to this machine: slurmd registers only under its own short hostname and with
#    no more CPUs or memory than it finds, so take both from `slurmd -C` (what slurmd will report).
HOST=$(hostname -s)
NODE_LINE=$(slurmd -C 2>/dev/null | head -n 1 || true)
CPUS=$(sed -n 's/.*\bCPUs=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
MEM=$(sed -n 's/.*\bRealMemory=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
[[ -n $CPUS ]] || CPUS=$(nproc)
[[ -n $MEM ]] || MEM=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
MEM=$((MEM * 95 / 100))  # headroom: memory reported at registration may dip a little below this boot's total
NEW_CONF=$(sed -e "s/@HOST@/$HOST/g" -e "s/@CPUS@/$CPUS/g" -e "s/@MEM_MB@/$MEM/g" "$TEMPLATE")
RESTART=no
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$NEW_CONF" ]]; then
    say "writing $CONF (node $HOST, CPUs=$CPUS, RealMemory=$MEM)"
    printf '%s\n' "$NEW_CONF" >"$CONF"
    RESTART=yes
fi

# 4. Daemons: (re)start when not running or when the configuration changed.
stop_daemon() { # stop_daemon PIDFILE NAME
    if running "$1" "$2"; then
        local pid; pid=$(cat "$1")
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
}
if [[ $RESTART == yes ]]; then
    stop_daemon /run/slurmd.pid slurmd
    stop_daemon /run/slurmctld.pid slurmctld
fi
if ! running /run/slurmctld.pid slurmctld; then
    say "starting slurmctld"
    slurmctld || fail "slurmctld did not start"
fi
if ! running /run/slurmd.pid slurmd; then
    say "starting slurmd"
    slurmd || fail "slurmd did not start"
fi

# 5. Wait until the node is idle (or busy with jobs); resume it when it is down or drained.
deadline=$((SECONDS + TIMEOUT))
state=""
while :; do
    state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1 || true)
    case $state in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|drained*|fail*)
            scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    ((SECONDS < deadline)) || fail "node $HOST is '${state:-not listed}' after ${TIMEOUT}s: $(scontrol show node "$HOST" 2>&1 | grep -o 'Reason=.*' || true)"
    sleep 1
done

# 6. A job runs end to end (controller -> slurmd -> process and back).
timeout 60 srun --quiet -N1 -n1 -t 1 true || fail "srun of a trivial job failed on node $HOST ($state)"
say "cluster up: node $HOST $state, partition $(sinfo -h -o %P | head -n 1), $((SECONDS - T0)) s"
