"""A/B of a shm client's put_batch (100 k keys of 64 B by default; N, VS, REPS in the
environment): modes shm-base (KVSHM_PACKED_PUT off), shm-packed (default), shm-inline
(KVSHM_INLINE_PUT on), tcp; wall keys/s and CPU us/key of client and server, load.
Run from the repository root: ``.venv/bin/python perf/bench_shmput.py shm-base shm-packed shm-inline tcp``."""
import sys, time, os, resource
sys.path.insert(0,'tests')
import kvshm, kvshm.client
from servers import ServerProcess
n=int(os.environ.get("N","100000"))
reps=int(os.environ.get("REPS","3"))
keys=[f"batch-{i:012d}".encode() for i in range(n)]
VS=int(os.environ.get("VS","64"))
vals=[bytes(VS)]*n
def scpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        p=f.read().rsplit(")",1)[1].split()
    return (int(p[11])+int(p[12]))/os.sysconf("SC_CLK_TCK")
def ccpu():
    return time.process_time()
modes=sys.argv[1:] or ["shm","tcp"]
with ServerProcess("--block-size","4",prealloc_size=1.0) as srv:
    pid=srv.proc.pid
    for rep in range(reps):
        for tr in modes:
            env=None
            if tr.startswith("shm"):
                kvshm.client.INLINE_PUT = tr=="shm-inline"
                kvshm.client.PACKED_PUT = tr!="shm-base"
                t_="shm"
            else: t_="tcp"
            with kvshm.Client(srv.address, transport=t_, timeout=120) as c:
                c.put_batch(keys, vals)
                res=[]
                for what in ("overwrite","fresh"):
                    if what=="fresh": c.delete(keys)
                    c0=ccpu(); s0=scpu(pid); t=time.perf_counter()
                    c.put_batch(keys, vals)
                    dt=time.perf_counter()-t; c1=ccpu(); s1=scpu(pid)
                    res.append(f"{what} {n/dt/1e6:.2f} M/s cli {(c1-c0)/n*1e6:.2f} srv {(s1-s0)/n*1e6:.2f} us/key")
                print(f"{tr:8s}", " | ".join(res), "| load", os.getloadavg()[0], flush=True)
