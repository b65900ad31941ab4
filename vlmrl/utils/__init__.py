"""Small helpers on kept libraries, at the bottom of the layering: nothing here imports the rest of vlmrl.

- `executor`: a thread pool of daemon threads, with a deadline-bounded call (`DaemonExecutor.call`);
- `processes`: process-tree kill, liveness, wait-for-exit (psutil) and `env_override`;
- `sequences`: `chunks` (fixed size) and `split_evenly` (fixed count);
- `paths`: vlmrl's cache folder ($VLMRL_CACHE, default ~/.cache/vlmrl);
- `partition`: balanced partitions of weighted items;
- `servers`: a server process vlmrl launches and owns (start, log file, health wait, process-group kill).
"""
