"""Helpers of the tests, one module by what it holds; the fixtures stay in tests/conftest.py.

- config: the toy target and prompts, the tests' base config (BASE_CONFIG) and writing a run's config
- workflow: running Snakemake on a run directory, in the foreground or in the background, and its files
- processes: /proc scans (a port's listeners, a vLLM's processes, a process's descendants)
- servers: free ports, a server's port record, a server checked gone, the toy server started by hand
- measure: a draft measured in vLLM
- slurm: the tests' own one-node SLURM cluster (ci/slurm.sh) and its client commands
- tiny_target: a tiny random Llama and fake traces for the tests that start no server
- scheduling: how xdist's processes split the suite (shared runs, units, order, CPU shares)
"""
