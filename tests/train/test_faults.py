"""MEGALOOP_FAULTS (megaloop.train.faults): what it parses, what it refuses in one line, and that a step fault is
injected by the first attempt that reaches its step only."""
import pytest
import torch

from megaloop.config import ConfigError
from megaloop.train.faults import Fault, Faults, parse


def test_parse_reads_each_kind_and_types_its_values():
    assert parse("slow:rank=2,seconds=0.3; crash:rank=1,at=start;spike:step=40") == [
        Fault("slow", {"rank": 2, "seconds": 0.3}), Fault("crash", {"rank": 1, "at": "start"}),
        Fault("spike", {"step": 40})]
    assert parse("") == []


@pytest.mark.parametrize("text, says", [
    ("boom:rank=1", "unknown fault 'boom'"), ("slow:rank=1", "missing seconds="),
    ("crash:rank=1", "exactly one of at=start or step=K"), ("crash:rank=x,at=start", "rank and step are integers"),
    ("spike:steps=3", "'steps=3' is not one of ['step']"), ("crash:rank=0,at=end", "at= takes only `start`")])
def test_bad_values_are_refused_with_what_was_wrong(text, says):
    with pytest.raises(ConfigError, match="MEGALOOP_FAULTS") as err:
        parse(text)
    assert says in str(err.value)


def test_a_step_fault_fires_once_per_run_and_only_on_its_ranks(tmp_path):
    batch = {"tokens": torch.arange(12).view(3, 4)}
    rank0 = Faults(0, tmp_path, "spike:step=5;slow:rank=1,seconds=0.5")
    assert [f.kind for f in rank0.faults] == ["spike"]  # the slow fault is rank 1's
    assert rank0.corrupt(4, batch, 512) is batch
    hit = rank0.corrupt(5, batch, 512)
    assert torch.equal(hit["tokens"], torch.full((3, 4), 511))
    assert torch.equal(batch["tokens"], torch.arange(12).view(3, 4))  # the loader's batch itself is untouched
    again = Faults(0, tmp_path, "spike:step=5")  # a later attempt of the same run reaches step 5 again
    assert again.corrupt(5, batch, 512) is batch
    assert not Faults(3, tmp_path, "slow:rank=1,seconds=0.5")
