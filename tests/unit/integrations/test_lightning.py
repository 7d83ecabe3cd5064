"""HPCEnvironment reports hpc's layout to Lightning and refuses one Lightning would get
wrong (read from a torchrun environment: rank 3 of 4, 2 nodes x 2)."""

from __future__ import annotations

import pytest

from hpc.errors import LaunchEnvironmentError

pytest.importorskip("lightning")

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "t1"}


@pytest.fixture
def env():  # noqa: ANN201
    from hpc.environments import detect
    from hpc.integrations.lightning import HPCEnvironment

    return HPCEnvironment(info=detect(TORCHRUN))


def test_the_layout_is_hpcs(env) -> None:  # noqa: ANN001
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == \
        (4, 3, 1, 1)
    assert (env.main_address, env.main_port) == ("node1", 29500)
    assert env.creates_processes_externally
    assert not env.detect()  # detect() reads this process: no launcher here
    kwargs = env.trainer_kwargs()
    assert (kwargs["devices"], kwargs["num_nodes"], kwargs["strategy"]) == (2, 2, "ddp")
    assert kwargs["plugins"] == [env]
    env.set_world_size(4)
    env.set_global_rank(3)
    env.validate_settings(2, 2)


def test_lightnings_own_numbers_must_agree(env) -> None:  # noqa: ANN001
    with pytest.raises(LaunchEnvironmentError, match=r"(?s)world size of 8 .* 4 ranks on 2 "
                       r"nodes \(2 per node, this is rank 3\).*devices=2, num_nodes=2"):
        env.set_world_size(8)
    with pytest.raises(LaunchEnvironmentError, match="numbers global rank 3 as 1"):
        env.set_global_rank(1)
    with pytest.raises(LaunchEnvironmentError, match=r"Trainer/Fabric\(devices=4, num_nodes=1\)"):
        env.validate_settings(4, 1)


def test_uneven_ranks_per_node_are_refused() -> None:
    from hpc.environments import DistInfo
    from hpc.integrations.lightning import HPCEnvironment

    info = DistInfo(launcher="slurm", rank=2, local_rank=0, world_size=3, local_world_size=1,
                    node_rank=1, num_nodes=2)  # 2 ranks on node 0, this one alone on node 1
    with pytest.raises(LaunchEnvironmentError, match="not the same number on every node"):
        HPCEnvironment(info=info).validate_settings(1, 2)


def test_without_lightning_the_import_names_the_extra() -> None:
    """A missing package (simulated: its import fails) gives the extra to install, and
    ``import hpc`` / ``hpc.integrations`` import no framework."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import hpc, hpc.integrations\n"
            "assert not any(m in sys.modules for m in ('lightning', 'accelerate')), 'imported'\n"
            "sys.modules['lightning'] = None  # import lightning now raises ImportError\n"
            "try:\n"
            "    import hpc.integrations.lightning\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HINT: pip install 'torch-hpc[lightning]'" in out.stdout, out.stdout


def test_a_resume_reopens_an_open_tensorboard_writer_with_the_purge_step(tmp_path) -> None:  # noqa: ANN001
    """The writer was open before the checkpoint was restored (a script that wrote to
    ``logger.experiment`` before ``fit``, or a strategy that restores after setup): it is
    closed, and the next log opens one with ``purge_step``, so the steps the resumed run
    logs again replace the crashed attempt's. A real TensorBoardLogger and its files; the
    Trainer is only the list of its loggers."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    from hpc.integrations.lightning import HPCPreemption
    from tests.helpers.trackers import tensorboard_steps, tensorboard_values

    logger = TensorBoardLogger(tmp_path, name="tb", version="v")
    for step in range(10):  # the crashed attempt got to step 9
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.save()
    # its checkpoint: 5 batches had stepped (Lightning adds one as it restarts)
    checkpoint = {"loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": 5}}}}
    stop = SimpleNamespace()  # not asked here
    HPCPreemption(tmp_path / "ck", stop).on_load_checkpoint(
        SimpleNamespace(loggers=[logger]), None, checkpoint)
    for step in range(6, 12):
        logger.log_metrics({"loss": 100.0 + step}, step=step)
    logger.finalize("success")
    assert sorted(tensorboard_steps(tmp_path / "tb" / "v", "loss")) == list(range(12))
    assert tensorboard_values(tmp_path / "tb" / "v", "loss") == {
        **{s: float(s) for s in range(6)}, **{s: 100.0 + s for s in range(6, 12)}}


def test_a_purge_step_the_user_set_is_kept(tmp_path) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from hpc.integrations.lightning import HPCPreemption

    mine = TensorBoardLogger(tmp_path, name="tb", purge_step=3)
    other = CSVLogger(tmp_path, name="csv")
    checkpoint = {"loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": 5}}}}
    HPCPreemption(tmp_path / "ck", SimpleNamespace()).on_load_checkpoint(
        SimpleNamespace(loggers=[mine, other]), None, checkpoint)
    assert mine._kwargs["purge_step"] == 3
