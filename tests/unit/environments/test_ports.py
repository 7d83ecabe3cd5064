"""Master ports derived from job ids (base.derive_port, slurm_port)."""

from __future__ import annotations

from hpc.environments.base import PORT_BASE, PORT_SPAN, DistInfo, derive_port
from hpc.environments.slurm import slurm_port

INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)



def test_derive_port_range_and_distinctness() -> None:
    ports = {(job, step): derive_port(job, step) for job in range(1, 2001) for step in range(4)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports.values())
    for job in range(1, 2001):
        assert len({ports[job, step] for step in range(4)}) == 4, f"job {job}: steps collide"
    for job in range(1, 2000):
        for step in range(4):
            assert ports[job, step] != ports[job + 1, step], f"jobs {job}, {job + 1} collide"
    # stronger and true for this range: (64 * job + step) % 17000 is injective here
    assert len(set(ports.values())) == len(ports)


def test_derive_port_is_stable_and_takes_strings() -> None:
    assert derive_port(30, 0) == derive_port("30", "0") == 15000 + 30 * 64
    assert derive_port("mpi", "1138622465") == 16369  # pinned: no per-process hash()
    assert derive_port("job-a", "x") == 20968
    assert PORT_BASE <= derive_port("mpi", "1138622465") < PORT_BASE + PORT_SPAN
    assert derive_port("mpi", 1) != derive_port("mpi", 2)


def test_slurm_port() -> None:
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "2"}
    assert slurm_port(env) == 15000 + (1234 * 64 + 2) % 17000
    assert slurm_port({"SLURM_JOBID": "1234", "SLURM_STEPID": "2"}) == slurm_port(env)
    ports = {slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
             for job in range(1, 2001) for step in range(4)}
    assert len(ports) == 8000
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    batch = slurm_port({"SLURM_JOB_ID": "1234"})
    assert batch == slurm_port({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "4294967294"})
    assert batch not in {slurm_port({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": str(s)})
                         for s in range(64)}


def test_slurm_port_step_slot_for_torchrun_sbatch() -> None:
    """slurm/torchrun.sbatch's rendezvous: slot 63 of the same rule, whatever the step."""
    for job in (1, 1234, 265624):
        for env in ({"SLURM_JOB_ID": str(job)}, {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"}):
            assert slurm_port(env, step=63) == 15000 + (job * 64 + 63) % 17000
