"""Every rank logs one INFO and one WARNING line; the global master also a file."""

import logging
import sys

import hpc

info = hpc.init_torch()
hpc.setup_logging(log_file=sys.argv[1])
log = logging.getLogger("roles")
log.info("info line from rank %d", info.rank)
log.warning("warning line from rank %d", info.rank)


@hpc.master_only
def write_marker() -> str:
    with open(sys.argv[1] + ".marker", "a") as fh:
        fh.write(f"{info.rank}\n")
    return "written"


print(f"MARKER rank={info.rank} result={write_marker()}", flush=True)
hpc.barrier()
