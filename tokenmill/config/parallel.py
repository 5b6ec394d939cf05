"""Where this node stands among several: torchrun-style flags, or the seed's MP_NNODE / POD_IPS
/ POD_0_IP / HOST_IP, or an MPI launcher's rank (values read through env.py's `Env`)."""

from __future__ import annotations


def node_settings(args, env, ranks: int) -> dict:
    """EngineConfig's node fields from the parsed flags and the environment: flags win; with
    POD_IPS this node's index is its address's place there (`mpirun start_server`: the MPI
    rank)."""
    nnodes = args.nnodes if args.nnodes is not None else env.integer("MP_NNODE") or 1
    out = {"nnodes": nnodes,
           "master_port": pick_first(args.master_port, env.integer("MASTER_PORT"), 29500)}
    if nnodes == 1:
        return out
    if not isinstance(nnodes, int) or nnodes < 1 or ranks % nnodes:
        raise ValueError(f"MP_NUM / tensor x pipeline parallel size ({ranks}) must be "
                         f"divisible by MP_NNODE / --nnodes ({nnodes}).")
    mpi_rank = env.integer("OMPI_COMM_WORLD_RANK", "PMI_RANK")
    pod_ips = [a.strip() for a in (env.text("POD_IPS") or "").split(",") if a.strip()]
    host_ip, node_rank = env.text("HOST_IP"), None
    if pod_ips:
        if len(pod_ips) != nnodes:
            raise ValueError(f"POD_IPS lists {len(pod_ips)} address(es) for MP_NNODE={nnodes} "
                             "nodes.")
        pod0 = env.text("POD_0_IP") or pod_ips[0]
        if pod0 != pod_ips[0]:
            raise ValueError(f"POD_0_IP {pod0} must be POD_IPS' first address ({pod_ips[0]}): "
                             "node 0 is the one listed first.")
        if host_ip is None:
            local = [a for a in pod_ips if _is_local(a)]
            if len(local) != 1:
                raise ValueError(f"Cannot tell which POD_IPS address is this node's "
                                 f"({', '.join(local) or 'none is local'}): set HOST_IP.")
            host_ip = local[0]
        if host_ip not in pod_ips:
            raise ValueError(f"HOST_IP {host_ip} is not in POD_IPS ({', '.join(pod_ips)}).")
        node_rank = pod_ips.index(host_ip)
        out["master_addr"] = pod0
    node_rank = pick_first(args.node_rank, mpi_rank, node_rank)
    if node_rank is None:
        raise ValueError(f"--nnodes {nnodes}: give --node-rank (or POD_IPS, or run under "
                         "mpirun).")
    master = pick_first(args.master_addr, env.text("MASTER_ADDR"), out.get("master_addr"))
    if master is None:
        raise ValueError(f"--nnodes {nnodes}: give --master-addr (node 0's address) or "
                         "POD_IPS / POD_0_IP.")
    out.update(node_rank=node_rank, master_addr=master, node_addr=host_ip)
    return out


def pick_first(*values):
    return next((v for v in values if v is not None), None)


def _is_local(address: str) -> bool:
    """Whether an address belongs to this machine (binding to it works)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET,
                           socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False
