"""Running AOTInductor packages without the GIL (`aoti_native`): the same bits as torch's package
loader, other Python threads running meanwhile, and the lanes that split one batched step over
several threads without changing any row."""

import threading
import time
import zipfile

import pytest
import torch

from metrale.runtime.backends.aoti_native import Lanes, NativeRunner, load_runner


def _target_inputs(rows: int, seqs: int = 6, slots: int = 64, seed: int = 0):
    """Inputs of the tiny target's batched step: `rows` decode rows of `seqs` sequences (none of
    them a tree's: no row hides a slot)."""
    g = torch.Generator().manual_seed(seed)
    kv = []
    for _ in range(4):
        kv += [torch.randn(seqs, 2, 32, slots, generator=g), torch.randn(seqs, slots, 2, 32, generator=g)]
    seq = torch.arange(rows) % seqs
    return [torch.randint(0, 2048, (rows,), generator=g), torch.randint(0, slots, (rows,), generator=g),
            seq, torch.arange(rows), torch.zeros(rows, dtype=torch.long), *kv]


@pytest.fixture(scope="module")
def target_package(aoti_engine_dir):
    return aoti_engine_dir / "target" / "cpu" / "steps.pt2"


def test_native_runs_equal_the_loaders(target_package):
    import torch._inductor

    native = load_runner(target_package, lanes=2)
    assert isinstance(native, NativeRunner) and native.lanes == 2
    loader = torch._inductor.aoti_load_package(str(target_package)).loader
    with torch.inference_mode():
        for rows in (1, 5, 32):
            a, b = _target_inputs(rows, seed=rows), _target_inputs(rows, seed=rows)
            got, want = native(a), loader.boxed_run(b)
            assert len(got) == len(want) == 3
            assert all(torch.equal(x, y) for x, y in zip(got, want))
            assert all(torch.equal(x, y) for x, y in zip(a[5:], b[5:]))  # the caches written alike


def test_other_threads_run_while_a_package_computes(target_package):
    """A Python thread counting beside a thread that loops package calls keeps a good share
    of its solo count (torch's loader holds the GIL through a call and leaves it almost none)."""
    runner = load_runner(target_package)
    args = _target_inputs(32)

    def count(seconds: float) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = count(0.3)
    stop = threading.Event()

    def loop():
        with torch.inference_mode():
            while not stop.is_set():
                runner(list(args))

    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(0.05)
        beside = count(0.3)
    finally:
        stop.set()
        t.join()
    assert beside > 0.1 * alone, (beside, alone)


def test_an_archive_of_another_layout_runs_through_the_loader(target_package, tmp_path):
    odd = tmp_path / "odd.pt2"
    with zipfile.ZipFile(target_package) as src, zipfile.ZipFile(odd, "w") as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item))
        dst.writestr("steps/data/weights/extra", b"")  # weights beside the library
    runner = load_runner(odd, lanes=2)
    assert not isinstance(runner, NativeRunner) and runner.lanes == 1
    with torch.inference_mode():
        got, want = runner(_target_inputs(3)), load_runner(target_package)(_target_inputs(3))
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_lanes_split_sequences_into_parts_of_about_equal_rows():
    lanes = Lanes(2)
    assert lanes.split([0, 1, 2, 3], [1, 1, 1, 1]) == [[0, 1, 2, 3]]  # too few rows to split
    assert lanes.split([0, 1, 2, 3, 4, 5, 6, 7], [1] * 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lanes.split([0, 1, 2], [30, 1, 1]) == [[0], [1, 2]]
    assert lanes.split([5], [64]) == [[5]]  # one sequence's rows are never split
    parts = Lanes(4).split(list(range(32)), [1] * 32)
    assert [len(p) for p in parts] == [8, 8, 8, 8] and sum(parts, []) == list(range(32))
    assert Lanes(1).split(list(range(32)), [1] * 32) == [list(range(32))]


def test_lanes_map_every_item_in_order_and_raise_once_all_finished():
    lanes = Lanes(3)
    assert lanes.map(lambda x: x * x, [1, 2, 3, 4, 5]) == [1, 4, 9, 16, 25]
    assert lanes.map(lambda x: x, []) == [] and Lanes(1).map(str, [1, 2]) == ["1", "2"]
    finished = []

    def part(p):
        if p == "bad":
            raise ValueError("this part failed")
        time.sleep(0.05)
        finished.append(p)

    with pytest.raises(ValueError, match="this part failed"):
        lanes.map(part, ["bad", "a", "b"])
    assert sorted(finished) == ["a", "b"]  # the others ran to their end first
    assert torch.is_inference_mode_enabled() is False
