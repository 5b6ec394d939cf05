"""How the ranks of a parallel engine are started and joined: worker processes on this node
(multiproc.py), Ray actors across nodes (ray_executor.py), and the rank process itself
(worker.py). The process groups and collectives they join are distributed/'s."""
