"""The save plan: regions must tile each array as a regular grid (the chunk shape); replicas get one writer,
chosen to balance bytes over ranks."""
import pytest

from checkpoints.plan import make_plan


def decl(name, gshape, offsets, shape, dtype="float32"):
    return (name, gshape, dtype, offsets, shape)


def test_tensor_parallel_split_gives_chunks_and_one_writer_per_chunk():
    per_rank = [[decl("w", (8, 4), (0, 0), (4, 4))], [decl("w", (8, 4), (4, 0), (4, 4))]]
    plan = make_plan(per_rank)
    assert plan.arrays["w"].chunks == (4, 4)
    assert plan.arrays["w"].writers == {(0, 0): 0, (4, 0): 1}


def test_replicas_are_written_once_and_balanced_by_bytes():
    # four ranks all hold the same eight arrays (pure data parallel): each rank writes two of them
    per_rank = [[decl(f"p{i}", (16,), (0,), (16,)) for i in range(8)] for _ in range(4)]
    plan = make_plan(per_rank)
    writers = [a.writers[(0,)] for a in plan.arrays.values()]
    assert sorted(writers) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [plan.bytes_of(r) for r in range(4)] == [128] * 4
    # a big array goes first; the small ones fill the other ranks
    big = [[decl("big", (1000,), (0,), (1000,)), decl("s1", (10,), (0,), (10,)), decl("s2", (10,), (0,), (10,))]
           for _ in range(2)]
    plan = make_plan(big)
    assert plan.arrays["big"].writers[(0,)] == 0
    assert plan.arrays["s1"].writers[(0,)] == 1 and plan.arrays["s2"].writers[(0,)] == 1


def test_same_plan_whatever_the_declaration_order():
    a = [[decl("x", (4,), (0,), (4,)), decl("y", (4,), (0,), (4,))]] * 2
    b = [[decl("y", (4,), (0,), (4,)), decl("x", (4,), (0,), (4,))]] * 2
    assert {n: p.writers for n, p in make_plan(a).arrays.items()} == {n: p.writers for n, p in make_plan(b).arrays.items()}


@pytest.mark.parametrize("per_rank, why", [
    ([[decl("m/w", (8,), (0,), (5,))], [decl("m/w", (8,), (5,), (3,))]], "different shapes"),
    ([[decl("m/w", (9,), (0,), (4,))], [decl("m/w", (9,), (4,), (4,))]], "does not divide"),
    ([[decl("m/w", (8,), (0,), (4,))], [decl("m/w", (8,), (2,), (4,))]], "not multiples"),
    ([[decl("m/w", (12,), (0,), (4,))], [decl("m/w", (12,), (4,), (4,))]], "2 regions of block"),
])
def test_non_tiling_regions_raise_naming_the_array(per_rank, why):
    with pytest.raises(ValueError, match=r"array 'm/w'.*do not tile") as err:
        make_plan(per_rank)
    assert why in str(err.value)


def test_disagreeing_dtypes_or_shapes_raise():
    with pytest.raises(ValueError, match="'w': ranks disagree"):
        make_plan([[decl("w", (4,), (0,), (4,))], [decl("w", (4,), (0,), (4,), dtype="bfloat16")]])
    with pytest.raises(ValueError, match="'w': ranks disagree"):
        make_plan([[decl("w", (4,), (0,), (4,))], [decl("w", (8,), (0,), (8,))]])
    with pytest.raises(ValueError, match="twice"):
        make_plan([[decl("w", (4,), (0,), (4,)), decl("w", (4,), (0,), (4,))]])
