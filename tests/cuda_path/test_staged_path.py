"""The staged copy path on the simulated device: byte-exact in every layout, ordered, bounded, and falling back.

The staged path (worker_side/backends/cuda/staging.py) gathers a job's blocks on the GPU into a staging slot
and moves the slot by DMA (loads the reverse). Its ordering rules, each shown necessary here by removing it
and watching bytes go wrong under adversarial stream schedules:
- a gather follows the forward's writes (the store fence on the kernel stream);
- a slot's DMA follows its gather, a scatter follows its slot's DMA (`slot_ready`);
- a slot is rewritten only after the copy that reads it completed (`slot_free`);
- a scatter follows the work launched before the step (the step fence, through the DMA it waits for), and
  a load is reported only after its last scatter, so the compute stream never reads a block still being
  written.
Random jobs are checked against the CPU backend as the oracle.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from cudasim_helpers import LAYOUTS, make_kv, random_fill, round_trip, sim_worker, vllm_allocation

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker
from worker_side.backends.cpu import CpuBackend
from worker_side.backends.cuda.backend import CudaBackend
from worker_side.backends.cuda.calibration import STAGED_TIE
from worker_side.backends.cuda.staging import NUM_SLOTS, StagedPath, StagingPlan
from worker_side.block_layout import tensor_block_view
from worker_side.host_pool import BLOCKS, PLANES, merges_across_tensors
from worker_side.testing.cuda_sim import SCHEDULES, SimCudaRuntime

pytestmark = pytest.mark.cudasim


def staged_worker(rt: SimCudaRuntime, kv: dict[str, torch.Tensor], num_gpu_blocks: int, layout: str | None = None,
                  slot_blocks: int = 2, num_cpu_blocks: int = 40, **options) -> OffloadWorker:
    """A worker staging every job through slots of `slot_blocks` blocks (jobs of more blocks take several
    chunks and reuse slots)."""
    probe = [tensor_block_view(n, t, num_gpu_blocks, layout) for n, t in kv.items()]
    bytes_per_block = sum(v.block_bytes for v in probe)
    backend = CudaBackend(runtime=rt, kernel_max_segment_bytes=0,
                          staging_bytes=2 * NUM_SLOTS * slot_blocks * bytes_per_block, **options)
    w = OffloadWorker(load_config({"num_cpu_blocks": num_cpu_blocks}), backend=backend)
    w.register_kv_caches(kv, num_gpu_blocks=num_gpu_blocks, layout=layout)
    assert w.backend.staged_off_reason is None and w.host_pool.layout == BLOCKS
    assert w.backend.paths.staged.plan.slot_blocks == slot_blocks
    return w


def sim_staged(seed: int, schedule: str = "copy_first", burst: int = 0, slot_blocks: int = 1):
    """A simulated device, a 2-layer K/V-first cache of 12 blocks and a worker staging through it."""
    rt = SimCudaRuntime(schedule=schedule, seed=seed, burst=burst)
    kv = make_kv(rt, "kv_first", num_layers=2)
    return rt, kv, staged_worker(rt, kv, 12, slot_blocks=slot_blocks)


# ---- 1. bytes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_round_trips_bit_exact_through_the_staging_ring(layout: str, schedule: str) -> None:
    rt = SimCudaRuntime(schedule=schedule, seed=5)
    kv = make_kv(rt, layout)
    w = staged_worker(rt, kv, 12, LAYOUTS[layout][0])
    round_trip(rt, w, kv, gpu=[1, 2, 3, 9, 5], cpu=[30, 31, 32, 7, 12], targets=[4, 5, 6, 11, 1])  # 3 chunks
    assert w.backend.num_jobs_by_path["staged"] == 2 and rt.calls["launch_staged_copy"] == 6
    w.shutdown()
    assert rt.registrations == {} and rt.faults == []


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC"])
def test_vllm_allocations_round_trip_staged_and_by_dma(layout: str) -> None:
    for staged in (True, False):
        rt = SimCudaRuntime(schedule="random", seed=11)
        kv = vllm_allocation(rt, layout)
        w = staged_worker(rt, kv, 12, layout) if staged else sim_worker(rt, kv, 12, layout, kernel_max_segment_bytes=0)
        round_trip(rt, w, kv, gpu=[2, 3, 4, 8], cpu=[10, 11, 12, 5], targets=[5, 6, 7, 1])
        assert w.backend.num_jobs_by_path["staged" if staged else "batch"] == 2
        w.shutdown()


def test_mla_latent_round_trips_staged() -> None:
    """MLA: one 'head' whose content is the latent (576 wide), a chunk per layer."""
    rt = SimCudaRuntime(schedule="copy_lag", seed=2)
    kv = vllm_allocation(rt, "LBHNC", num_layers=3, heads=1, content=576)
    w = staged_worker(rt, kv, 12, "LBHNC", slot_blocks=3)
    round_trip(rt, w, kv, gpu=[1, 2, 3, 4, 5, 6, 7], cpu=[1, 3, 5, 7, 9, 11, 13], targets=[11, 10, 9, 8, 7, 6, 5])
    w.shutdown()


# ---- 2. layout detection ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("layout", "merges"), [("LBHNC", False), ("LBNHC", False), ("LHBNC", False),
                                                ("BLHNC", True), ("BLNHC", True)])
def test_block_outermost_allocations_are_one_range_per_block(layout: str, merges: bool) -> None:
    """Per-layer views of one block-outermost allocation: every layer of a block is one range, so a run of
    blocks is one DMA segment, with or without staging; layer-compact layouts keep a segment per layer."""
    rt = SimCudaRuntime(seed=0)
    kv = vllm_allocation(rt, layout, num_layers=4)
    views = [tensor_block_view(n, t, 12, layout) for n, t in kv.items()]
    assert merges_across_tensors(views) == merges
    w = sim_worker(rt, kv, 12, layout, kernel_max_segment_bytes=0)  # no staging: the layout alone decides
    assert w.host_pool.layout == (BLOCKS if merges else PLANES)
    geometry = w.backend.paths.geometry["store"]
    if merges:
        assert geometry.num_planes == 1 and geometry.bytes_per_block == w.bytes_per_block
        segs = geometry.segments(np.array([3, 4, 5, 9]), np.array([7, 8, 9, 2]))
        assert len(segs) == 2 and segs.nbytes.tolist() == [3 * w.bytes_per_block, w.bytes_per_block]
    else:
        assert geometry.num_planes == len(views) * views[0].num_chunks
    w.shutdown()


def test_kv_first_and_separate_layer_tensors_never_merge() -> None:
    rt = SimCudaRuntime(seed=0)
    kv = make_kv(rt, "kv_first", num_layers=3)
    assert not merges_across_tensors([tensor_block_view(n, t, 12) for n, t in kv.items()])


# ---- 3. ordering: each wait shown necessary ------------------------------------------------------------------
def _no_fences_on_kernel_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: the staging kernel streams skip their fences (a staged store's only one)."""
    from worker_side.backends.cuda.fences import StepFences

    original, original_init = StepFences.order, StagedPath.__init__
    kernel_streams: set[int] = set()
    alive: list[object] = []  # ids stay unique while the objects live

    def init(self: StagedPath, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        alive.extend(self.streams)
        kernel_streams.update(id(stream) for stream in self.streams)

    def order(self: StepFences, kind: str, stream: object) -> None:
        if id(stream) not in kernel_streams:
            original(self, kind, stream)

    monkeypatch.setattr(StagedPath, "__init__", init)
    monkeypatch.setattr(StepFences, "order", order)


def _stale_stores(seeds: range) -> int:
    """The forward (compute-stream work) writes blocks 1..4, then their store is submitted: runs where the
    host blocks got the bytes from before the forward."""
    stale = 0
    for seed in seeds:
        rt, kv, w = sim_staged(seed)
        w.begin_step()
        tensors = list(kv.values())
        rt.launch_host_work(rt.compute_stream(), lambda tensors=tensors: [t[:, 1:5].fill_(3.0) for t in tensors])
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3, 4], store_cpu_blocks=[5, 6, 7, 8]))
        w.wait_all()
        w.get_finished()
        rt.drain()  # the forward ran (a store that does not wait for it may be over before it ran)
        want = [torch.cat([v.block_tensor(b) for v in w._views]) for b in (1, 2, 3, 4)]
        stale += any(not torch.equal(w.host_pool[c], x) for c, x in zip((5, 6, 7, 8), want, strict=True))
        w.shutdown()
    return stale


def test_a_staged_store_follows_the_forward_that_wrote_its_blocks() -> None:
    assert _stale_stores(range(8)) == 0


def test_without_its_fence_the_gather_reads_blocks_before_the_forward_wrote_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_fences_on_kernel_streams(monkeypatch)
    assert _stale_stores(range(8)) > 0


def _drop_waits_on(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Make `rt.wait_event` a no-op for the staging ring's `slot_ready` or `slot_free` events, or the helper
    stream's `go` or `joined` (helper_stream.py)."""
    original = StagedPath.__init__

    def init(self: StagedPath, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        events = set()
        for ring in self.rings.values():
            found = getattr(ring.helper, which) if which in ("go", "joined") else getattr(ring, which)
            events |= {id(e) for e in (found if isinstance(found, list) else [found])}
        rt_wait = self.rt.wait_event

        def wait_event(stream: object, event: object) -> None:
            if id(event) not in events:
                rt_wait(stream, event)

        self.rt.wait_event = wait_event  # type: ignore[method-assign]

    monkeypatch.setattr(StagedPath, "__init__", init)


def _multi_chunk_round_trips(seeds: range, schedule: str) -> int:
    """Round trips of 9-block jobs through 1-block slots (9 chunks, each slot reused 4 times); how many
    came back wrong."""
    wrong = 0
    for seed in seeds:
        rt = SimCudaRuntime(schedule=schedule, seed=seed, burst=4)
        kv = make_kv(rt, "kv_first", num_layers=2)
        w = staged_worker(rt, kv, 12, slot_blocks=1)
        try:
            round_trip(rt, w, kv, gpu=[1, 2, 3, 4, 5, 6, 7, 8, 9], cpu=[21, 5, 9, 33, 2, 17, 8, 30, 11],
                       targets=[11, 10, 9, 8, 7, 6, 5, 4, 3])
        except AssertionError:
            wrong += 1
        w.shutdown()
    return wrong


@pytest.mark.parametrize("which", ["slot_ready", "slot_free"])
def test_each_slot_event_is_needed(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Without `slot_ready` a DMA can copy a slot before its gather (or a scatter before its DMA); without
    `slot_free` a gather can overwrite a slot whose DMA has not run. Deep queues (`copy_lag`: the copy and
    kernel streams run rarely, so a whole job is queued before much of it runs) find both."""
    assert _multi_chunk_round_trips(range(12), "copy_lag") == 0
    _drop_waits_on(monkeypatch, which)
    assert _multi_chunk_round_trips(range(12), "copy_lag") > 0, f"no run noticed the missing {which} wait"


def _store_after_load_wrong(seeds: range) -> int:
    """`job.after`: a store rewrites host blocks that this step's load still reads (1-block slots: the
    store's chunks take turns on the copy stream and its helper). Runs whose load read the new bytes."""
    wrong = 0
    for seed in seeds:
        rt, kv, w = sim_staged(seed, "copy_lag")  # burst 0: nothing runs until waited for
        views = w._views
        w.begin_step()
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3, 4], store_cpu_blocks=[5, 6, 7, 8]))
        w.wait_all()
        w.get_finished()
        expected = [[v.block_tensor(b) for v in views] for b in (1, 2, 3, 4)]
        w.begin_step()
        meta = TransferMetadata(load_event=2, load_gpu_blocks=[9, 10, 11, 1], load_cpu_blocks=[5, 6, 7, 8],
                                load_event_reqs=["r"], store_event=3, store_gpu_blocks=[5, 6, 7, 8],
                                store_cpu_blocks=[5, 6, 7, 8], store_after_load=True)
        w.start_load(meta)
        w.start_store(meta)
        w.wait_all()
        w.get_finished()
        wrong += any(not all(torch.equal(v.block_tensor(b), expected[i][j]) for j, v in enumerate(views))
                     for i, b in enumerate((9, 10, 11, 1)))
        w.shutdown()
    return wrong


def _reported_store_wrong(seeds: range) -> int:
    """Runs where a staged store was reported done while a host block it writes did not hold its bytes yet."""
    wrong = 0
    for seed in seeds:
        rt, kv, w = sim_staged(seed, "copy_lag", burst=2)
        expected = [torch.cat([v.block_tensor(b) for v in w._views]) for b in (1, 2, 3, 4)]
        w.begin_step()
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3, 4], store_cpu_blocks=[5, 6, 7, 8]))
        for _ in range(400):  # poll as the engine does: the store counts as done once reported
            if w.get_finished().completed_store_events:
                break
            rt._queues.tick()
        wrong += any(not torch.equal(w.host_pool[c], x) for c, x in zip((5, 6, 7, 8), expected, strict=True))
        rt.drain()
        w.shutdown()
    return wrong


def test_a_staged_store_after_a_load_waits_on_every_dma_stream() -> None:
    assert _store_after_load_wrong(range(30)) == 0


def test_a_staged_store_is_reported_once_every_dma_stream_wrote() -> None:
    assert _reported_store_wrong(range(12)) == 0


@pytest.mark.parametrize(("which", "check"), [("go", _store_after_load_wrong), ("joined", _reported_store_wrong)])
def test_the_helper_dma_stream_is_joined_both_ways(monkeypatch: pytest.MonkeyPatch, which: str, check) -> None:
    """Chunks take turns on the copy stream and a helper: the helper starts after what the copy stream waited
    for (`go`, recorded by `Helper.follow`: the loads in `job.after`), and a store's completion follows the
    helper (`joined`, by `Helper.rejoin`). Without either, bytes go wrong."""
    _drop_waits_on(monkeypatch, which)
    assert check(range(30)) > 0, f"no run noticed the missing {which} wait"


def test_a_load_is_reported_only_after_its_last_scatter() -> None:
    """poll() reports a staged load once its completion event fired; that event follows the last scatter,
    so the blocks hold the loaded bytes at the moment the report is made, whatever ran so far."""
    for seed in range(10):
        rt = SimCudaRuntime(schedule="random", seed=seed, burst=1)
        kv = make_kv(rt, "kv_first", num_layers=2)
        w = staged_worker(rt, kv, 12, slot_blocks=1)
        views = w._views
        w.begin_step()
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3], store_cpu_blocks=[4, 5, 6]))
        w.wait_all()
        w.get_finished()
        expected = [[v.block_tensor(b) for v in views] for b in (1, 2, 3)]
        w.begin_step()
        w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=[7, 8, 9], load_cpu_blocks=[4, 5, 6],
                                      load_event_reqs=["r"]))
        for _ in range(200):
            if w.get_finished().finished_load_reqs == ["r"]:
                for i, b in enumerate((7, 8, 9)):
                    assert all(torch.equal(v.block_tensor(b), expected[i][j]) for j, v in enumerate(views))
                break
            rt._queues.tick()
        else:
            pytest.fail("the load never completed")
        w.shutdown()


def _early_scatters(seeds: range) -> int:
    """Compute queued before begin_step reads block 5, which this step's load overwrites: runs where the
    reader saw the loaded bytes instead of the old ones."""
    early = 0
    for seed in seeds:
        rt, kv, w = sim_staged(seed, slot_blocks=2)
        w.begin_step()
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1], store_cpu_blocks=[3]))
        w.wait_all()
        w.get_finished()
        seen = []
        view = w._views[0]
        rt.launch_host_work(rt.compute_stream(), lambda view=view, seen=seen: seen.append(view.block_tensor(5).clone()))
        before = view.block_tensor(5).clone()
        w.begin_step()
        w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=[5], load_cpu_blocks=[3], load_event_reqs=["r"]))
        rt.drain()
        early += not torch.equal(seen[0], before)
        w.shutdown()
    return early


def test_a_staged_load_waits_for_work_launched_before_the_step() -> None:
    """The scatter waits for the reader launched before the step: through the DMA it waits for, which the
    copy stream issues after the step fence."""
    assert _early_scatters(range(8)) == 0


def test_without_its_fence_a_staged_load_overwrites_blocks_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged path places a load's one fence (the step fence, on the copy stream): without it the
    scatter can overwrite block 5 before the reader launched before the step ran."""
    from worker_side.backends.cuda.fences import StepFences

    original = StepFences.order

    def stores_only(self: StepFences, kind: str, stream: object) -> None:
        if kind == "store":
            original(self, kind, stream)

    monkeypatch.setattr(StepFences, "order", stores_only)
    assert _early_scatters(range(8)) > 0


# ---- 4. the CPU backend as oracle -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_random_jobs_match_the_cpu_backend(seed: int) -> None:
    """The same random stores and loads through the staged CUDA path (simulated device) and the CPU backend
    leave the same bytes in every GPU block and every host block."""
    rng = np.random.default_rng(seed)
    rt = SimCudaRuntime(schedule=SCHEDULES[seed % len(SCHEDULES)], seed=seed)
    kv_sim = vllm_allocation(rt, ("LBHNC", "BLHNC", "LHBNC")[seed % 3], num_layers=3, num_blocks=24)
    kv_cpu = {n: t.clone() for n, t in kv_sim.items()}
    layout = ("LBHNC", "BLHNC", "LHBNC")[seed % 3]
    sim = staged_worker(rt, kv_sim, 24, layout, slot_blocks=1 + seed % 3, num_cpu_blocks=30)
    cpu = OffloadWorker(load_config({"num_cpu_blocks": 30}), backend=CpuBackend(num_threads=2))
    cpu.register_kv_caches(kv_cpu, num_gpu_blocks=24, layout=layout)
    for event in range(1, 41):
        n = int(rng.integers(1, 9))
        gpu = rng.choice(np.arange(1, 24), n, replace=False).tolist()
        host = rng.choice(np.arange(1, 30), n, replace=False).tolist()
        meta = (TransferMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=host) if rng.random() < 0.5
                else TransferMetadata(load_event=event, load_gpu_blocks=gpu, load_cpu_blocks=host, load_event_reqs=["r"]))
        for w in (sim, cpu):
            w.begin_step()
            (w.start_store if meta.store_event is not None else w.start_load)(meta)
            w.wait_all()
            w.get_finished()
    for b in range(1, 30):
        assert torch.equal(sim.host_pool[b], cpu.host_pool[b]), f"host block {b}"
    for name in kv_sim:
        assert torch.equal(kv_sim[name].contiguous().view(torch.int16), kv_cpu[name].contiguous().view(torch.int16)), name
    assert rt.faults == []
    sim.shutdown()
    cpu.shutdown()


# ---- 5. bounds and fallbacks ---------------------------------------------------------------------------------
def test_the_ring_is_allocated_once_at_bind_and_named_in_the_startup_line(caplog: pytest.LogCaptureFixture) -> None:
    rt = SimCudaRuntime(seed=0)
    kv = make_kv(rt, "kv_first", num_layers=2)  # 2 layers x K, V x 128 bytes: 512-byte blocks
    with caplog.at_level(logging.INFO, logger="worker_side.backends.cuda.backend"):
        w = sim_worker(rt, kv, 12, kernel_max_segment_bytes=0, staging_bytes=64 << 10)
    plan = w.backend.paths.staged.plan
    assert w.bytes_per_block == 512 and plan == StagingPlan(512, 16)  # 64 KiB / 8 slots / 512 bytes
    lines = [r.getMessage() for r in caplog.records if "copy paths" in r.getMessage()]
    assert lines == ["offload: copy paths on device 0: load: staged; store: staged; staging ring 64 KiB of GPU "
                     "memory (4 slots of 16 blocks, 8 KiB each, per direction)"], lines
    allocations = rt.calls["alloc_device"]
    round_trip(rt, w, kv, gpu=[1, 2, 3], cpu=[4, 5, 6], targets=[7, 8, 9])
    assert rt.calls["alloc_device"] == allocations  # nothing allocated per job
    w.shutdown()


def test_no_room_on_the_device_falls_back_to_dma_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    rt = SimCudaRuntime(seed=0)
    kv = make_kv(rt, "kv_first", num_layers=2)
    used = sum(t.numel() * t.element_size() for t in kv.values())
    rt.device_memory_limit = used + 1024  # the KV cache fits, a 64 KiB ring does not
    with caplog.at_level(logging.WARNING, logger="worker_side.backends.cuda.backend"):
        w = sim_worker(rt, kv, 12, kernel_max_segment_bytes=0, staging_bytes=64 << 10)
    assert w.backend.paths.staged is None and "could not be had" in w.backend.staged_off_reason
    assert any("staged copies off" in r.getMessage() for r in caplog.records)
    round_trip(rt, w, kv, gpu=[1, 2], cpu=[4, 5], targets=[7, 8])
    assert w.backend.num_jobs_by_path["batch"] == 2 and w.backend.num_jobs_by_path["staged"] == 0
    w.shutdown()


def test_a_block_larger_than_a_slot_is_refused_with_the_size_needed() -> None:
    rt = SimCudaRuntime(seed=0)
    kv = make_kv(rt, "kv_first", num_layers=2)
    w = sim_worker(rt, kv, 12, kernel_max_segment_bytes=0, staging_bytes=2048)  # 256-byte slots, 512-byte blocks
    assert "raise it to at least 4,096" in w.backend.staged_off_reason
    w.shutdown()


def test_a_full_argument_ring_sends_the_job_by_dma() -> None:
    rt = SimCudaRuntime(seed=0, burst=0)  # nothing runs until drained: job 1's ids stay in use
    kv = make_kv(rt, "kv_first", num_layers=2)
    w = staged_worker(rt, kv, 12, ring_entries=8)
    for event, ids in enumerate(([1, 2, 3], [4, 5, 6]), start=1):
        w.start_store(TransferMetadata(store_event=event, store_gpu_blocks=ids, store_cpu_blocks=ids))
    rt.drain()
    assert sorted(w.get_finished().completed_store_events) == [1, 2]
    assert w.backend.num_jobs_by_path["staged"] == 1 and w.backend.num_jobs_by_path["batch"] == 1
    assert rt.faults == []
    w.shutdown()


def test_a_launch_failing_mid_job_fails_the_job_after_what_was_enqueued() -> None:
    """The second chunk's launch fails: the job is reported failed, its argument entries are held until the
    first chunk's copies ran, and nothing is reported while they may still run."""
    rt = SimCudaRuntime(seed=0, burst=0)
    kv = make_kv(rt, "kv_first", num_layers=2)
    w = staged_worker(rt, kv, 12, slot_blocks=1)
    original = rt.launch_staged_copy
    calls = []

    def second_fails(*args, **kwargs) -> None:
        calls.append(1)
        if len(calls) == 2:
            from worker_side.backends.cuda.api import CudaError
            raise CudaError("cuLaunchKernel: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (test)")
        original(*args, **kwargs)

    rt.launch_staged_copy = second_fails
    w.begin_step()
    w.start_load(TransferMetadata(load_event=1, load_gpu_blocks=[1, 2, 3], load_cpu_blocks=[4, 5, 6],
                                  load_event_reqs=["r"]))
    assert w.backend.num_failed_submissions == 1
    assert w.get_finished().finished_load_reqs == []  # the first chunk's scatter has not run: not reported
    ring = w.backend.paths.kernel_args.rings["load"]
    assert ring.num_free < ring.capacity
    rt.drain()
    report = w.get_finished()
    assert report.finished_load_reqs == ["r"] and sorted(report.failed_load_gpu_blocks) == [1, 2, 3]
    assert ring.num_free == ring.capacity
    w.shutdown()


# ---- 6. the calibration ------------------------------------------------------------------------------------------
def test_calibration_stages_small_segments_and_keeps_dma_for_whole_blocks() -> None:
    """On the simulated device DMA pays per segment: staging wins where a block is many small chunks (a
    layer-compact cache), and loses where a block is already one range (block-outermost)."""
    for layout, staged in (("LBHNC", True), ("BLHNC", False)):
        rt = SimCudaRuntime(seed=0)
        kv = vllm_allocation(rt, layout, num_layers=16, num_blocks=80, heads=2, tokens=16, content=64)
        backend = CudaBackend(runtime=rt, kernel_max_segment_bytes=0, staging_bytes=16 << 20, calibrate=True)
        w = OffloadWorker(load_config({"num_cpu_blocks": 100}), backend=backend)
        w.register_kv_caches(kv, num_gpu_blocks=80, layout=layout)
        measured = [m for m in backend.calibration if hasattr(m, "staged_wins")]
        assert {m.kind for m in measured} == {"load", "store"}
        for kind in ("load", "store"):
            assert (kind in backend.policy.staged) == staged, (layout, backend.policy.describe())
        for m in measured:  # a tie (within STAGED_TIE) goes to staging: less host time per job
            assert m.staged_wins == (m.staged_s <= m.direct_s * (1 + STAGED_TIE))
        assert rt.faults == []
        w.shutdown()


def test_a_random_fill_is_not_zero() -> None:  # the round trips above compare random bytes, never zeros
    rt = SimCudaRuntime(seed=0)
    t = random_fill(rt.alloc_device((64,), torch.float16), 1)
    assert t.view(torch.uint8).count_nonzero() > 100


# ---- 7. what the metrics say -----------------------------------------------------------------------------------
def test_reports_count_jobs_by_the_path_they_took() -> None:
    """Each rank's report says how many of its reported jobs took each path; the scheduler side sums the
    ranks into the counters vLLM exports (num_staged_jobs, num_dma_jobs, num_kernel_jobs)."""
    from offload_connector.metadata import WorkerReport
    from scheduler_side.completions import count_paths
    from scheduler_side.stats import SchedulerStats

    rt = SimCudaRuntime(seed=0)
    kv = make_kv(rt, "kv_first", num_layers=2)
    w = staged_worker(rt, kv, 12, ring_entries=8)  # a 3-block job fits the ring; a second one waits for room
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3], store_cpu_blocks=[1, 2, 3]))
    w.start_store(TransferMetadata(store_event=2, store_gpu_blocks=[4, 5, 6], store_cpu_blocks=[4, 5, 6]))
    w.wait_all()
    report = w.get_finished()
    assert report.jobs_by_path == {"staged": 1, "batch": 1}
    stats = SchedulerStats()
    count_paths(stats, report.jobs_by_path)
    count_paths(stats, WorkerReport(rank=1, jobs_by_path={"staged": 2, "kernel": 1, "pageable": 1}).jobs_by_path)
    assert (stats.num_staged_jobs, stats.num_dma_jobs, stats.num_kernel_jobs) == (3, 2, 1)
    w.shutdown()
