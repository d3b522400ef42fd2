"""Which requests a failed load hurts (`WorkerReport.failed_load_reqs`): vLLM takes failed loads of hybrid
models by request, not by block id. Real worker and CPU backend; the fault injector fails whole events."""

from __future__ import annotations

import numpy as np
import torch

from offload_connector.config import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import CpuBackend, OffloadWorker
from worker_side.job_record import JobRecord, failed_requests
from worker_side.testing.faults import FaultyBackend


def record(counts: tuple[int, ...], dst: list[int]) -> JobRecord:
    return JobRecord("load", 0, len(dst), 0.0, ("a", "b", "c"), counts, np.asarray(dst, dtype=np.int64))


def test_a_failed_block_names_only_the_request_it_belongs_to() -> None:
    rec = record((2, 1, 3), [5, 6, 7, 8, 9, 10])
    assert failed_requests(rec, [7]) == ["b"]
    assert failed_requests(rec, [6, 10]) == ["a", "c"]
    assert failed_requests(rec, []) == []


def test_without_per_request_counts_every_request_of_the_job_is_named() -> None:
    assert failed_requests(record((), [5, 6, 7]), [7]) == ["a", "b", "c"]
    assert failed_requests(record((1, 1, 2), [5, 6, 7]), [7]) == ["a", "b", "c"]  # counts disagree


def test_the_worker_reports_the_requests_of_a_failed_load() -> None:
    worker = OffloadWorker(load_config({"num_cpu_blocks": 8}),
                           backend=FaultyBackend(CpuBackend(1), fail_loads={0}))
    worker.register_kv_caches({"layer": torch.zeros(2, 8, 4, 1, 4)}, num_gpu_blocks=8)
    worker.start_load(TransferMetadata(load_event=0, load_gpu_blocks=[1, 2, 3], load_cpu_blocks=[1, 2, 3],
                                       load_event_reqs=["a", "b"], load_req_num_blocks=[1, 2]))
    report = worker.get_finished(wait_for_loads=True)
    assert sorted(report.finished_load_reqs) == ["a", "b"]
    assert sorted(report.failed_load_reqs) == ["a", "b"] and sorted(report.failed_load_gpu_blocks) == [1, 2, 3]
    worker.start_load(TransferMetadata(load_event=1, load_gpu_blocks=[4], load_cpu_blocks=[4],
                                       load_event_reqs=["c"], load_req_num_blocks=[1]))
    report = worker.get_finished(wait_for_loads=True)
    assert (report.finished_load_reqs, report.failed_load_reqs) == (["c"], [])
    worker.shutdown()
