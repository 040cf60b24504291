"""Two real processes with a gloo process group: all_gather_object from torch.distributed drives the save."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoints import Checkpointer, CheckpointReader, Piece, wait_committed

pytestmark = pytest.mark.multiproc


def gather_with(group_size):
    def all_gather_object(obj):
        out = [None] * group_size
        dist.all_gather_object(out, obj)
        return out
    return all_gather_object


def worker(rank, world, init_file, root):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        mine = [Piece("model/w", (4, 6), (0, 3 * rank), full[:, 3 * rank:3 * rank + 3]),
                Piece("model/shared", (3,), (0,), torch.ones(3).bfloat16())]
        with Checkpointer(root, rank=rank, world_size=world, all_gather_object=gather_with(world)) as ckpt:
            ckpt.save(5, mine, {"tokens": 5})
            result = ckpt.wait()
        assert result.ok, result.error
        wait_committed(root, 5, timeout_s=60, token=result.token)
        reader = CheckpointReader(f"{root}/step_00000005")
        reader.verify()
        assert torch.equal(reader.read("model/w"), full)
        assert torch.equal(reader.read("model/shared"), torch.ones(3).bfloat16())
    finally:
        dist.destroy_process_group()


def test_gloo_ranks_save_one_checkpoint(tmp_path):
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(tmp_path / "ckpt")), nprocs=2, join=True)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000005"
