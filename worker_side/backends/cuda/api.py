"""The one seam between the CUDA transfer backend and CUDA itself.

`CudaBackend` performs every CUDA operation through a `CudaRuntime` object handed to it: the real one
(`cuda_runtime.TorchCudaRuntime`, the runtime and driver torch already loaded) on a GPU, or the simulated
device (`cuda_sim.SimCudaRuntime`) in tests and benchmarks, where streams are queues run in adversarial
orders and a missing fence becomes an integrity error. Nothing outside this seam may call CUDA.

Semantics every implementation follows (CUDA's own):
- Streams and events are opaque handles created on the *calling thread's current device*; a stream or
  event must only be used while its device is current. A new thread starts on device 0, so every thread
  sets its device (`set_device`) before its first call; `set_device(d)` when `d` is already current is a
  no-op that creates no context.
- `record_event(e, s)` captures the work enqueued on `s` so far; `wait_event(s, e)` makes later work on
  `s` wait for the *most recent* record of `e` at the time of the call (a never-recorded event: no wait);
  `query_event(e)` is True once that work completed; `synchronize_event(e)` blocks the host until then.
- `host_register(ptr, nbytes)` pins whole pages in the current device's context; ranges must not share a
  page with an existing registration. A copy whose host range is not inside one registration is an error
  (`cuMemcpyBatchAsync` rejects it; the kernel would fault), except `memcpy(..., pageable=True)`, CUDA's
  legal but staged copy from ordinary memory, used only after pinning failed.
- `memcpy_batch` submits all segments in one call (no order among them; they never overlap);
  `launch_block_copy` launches the gather/scatter kernel (segment_copy.cu): for every block pair
  `(src_ids[i], dst_ids[i])` and every plane `p` of a `(num_planes, 5)` int64 table of rows
  `(src_base, dst_base, src_stride, dst_stride, chunk_bytes)` it copies `chunk_bytes` from
  `src_base + src_id * src_stride` to `dst_base + dst_id * dst_stride`. The plane table and the ids (`src_ids`
  then `dst_ids`, `num_blocks` each) live in registered host memory and are read when the kernel runs. Its
  grid is capped by the runtime (a few SMs' worth of thread blocks, `kernel_max_sms`), so a copy that
  overlaps the forward never competes with it for every SM. A launch that raises enqueued nothing.
- `launch_staged_copy` launches the staged path's kernel (segment_copy.cu `oc_staged_copy`): the same table
  semantics, but every copy is device memory to device memory of one device (the KV cache and a staging
  slot), the plane table lives in device memory and the block ids (`src_ids`, `dst_ids`, `num_blocks` each)
  in registered host memory, read when it runs; at most `max_blocks` thread blocks and `num_blocks` <= 1024.
- `alloc_device_bytes(nbytes)` returns a uint8 tensor of the current device's memory, holding it while referenced;
  CudaError when there is no room.
- `device_of` is a driver call: it runs in the current device's context (creating it if none is current),
  so callers make the right device current first; `tensor_device` reads the framework's metadata only.
- `can_use_host_pointer(d)` is CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: where it is 0 a
  kernel cannot read registered host memory at its host address, and the kernel must not be launched.
- `supports_kernel` may compile the kernel (for the current device); `kernel_error` says in one line why it
  is False (cupy, NVRTC or the CUDA headers missing, cupy built for another CUDA major than torch).
- Timing: `create_event(timing=True)`, then `elapsed_s(start, end)` once both completed.
- `close()` releases what the runtime itself holds (retained primary contexts); call it once, at shutdown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

Stream = Any  # opaque, owned by the runtime
Event = Any


class CudaError(RuntimeError):
    """A CUDA call failed; the message names the call and CUDA's error name."""


class CudaRuntime(Protocol):
    name: str
    supports_batch: bool  # one call for many segments (cuMemcpyBatchAsync, CUDA >= 12.8 drivers)
    supports_kernel: bool  # the segment-copy kernel is available (compiled for this device)

    # ---- devices and memory ownership ----------------------------------------------------------------
    def get_device(self) -> int: ...
    def set_device(self, device: int) -> None: ...
    def device_of(self, ptr: int, nbytes: int) -> int | None:
        """The device whose memory holds [ptr, ptr + nbytes), or None for host memory."""
    def tensor_device(self, tensor: torch.Tensor) -> int | None:
        """The CUDA device holding `tensor` per the framework (no driver call), or None for host memory."""
    def numa_node(self, device: int) -> int | None:
        """The host NUMA node closest to `device`, or None where the system does not say."""
    def num_sms(self, device: int) -> int:
        """Streaming multiprocessors of `device`."""
    def can_use_host_pointer(self, device: int) -> bool:
        """CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM of `device`."""
    @property
    def kernel_error(self) -> str | None:
        """Why `supports_kernel` is False, in one line; None when it is True."""
    def close(self) -> None:
        """Release what the runtime holds (retained contexts); the runtime is not used afterwards."""

    # ---- streams and events (current device) -----------------------------------------------------------
    def compute_stream(self) -> Stream:
        """The engine's current stream on the current device (where the forward runs)."""
    def create_stream(self, low_priority: bool, high_priority: bool = False) -> Stream:
        """A new stream; `high_priority`: its kernels are scheduled before queued work of other streams."""
    def create_event(self, timing: bool = False) -> Event: ...
    def elapsed_s(self, start: Event, end: Event) -> float:
        """Seconds between two completed timing events (`create_event(timing=True)`)."""
    def record_event(self, event: Event, stream: Stream) -> None: ...
    def wait_event(self, stream: Stream, event: Event) -> None: ...
    def query_event(self, event: Event) -> bool: ...
    def synchronize_event(self, event: Event) -> None: ...
    def synchronize_stream(self, stream: Stream) -> None: ...

    # ---- host memory ---------------------------------------------------------------------------------
    def host_register(self, ptr: int, nbytes: int) -> None: ...
    def host_unregister(self, ptr: int) -> None: ...

    # ---- copies (each call below is one submission) ---------------------------------------------------
    def memcpy(self, dst: int, src: int, nbytes: int, stream: Stream, pageable: bool = False) -> None: ...
    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: Stream) -> None: ...
    def launch_block_copy(self, planes_ptr: int, num_planes: int, ids_ptr: int, num_blocks: int,
                          stream: Stream) -> None: ...
    def launch_staged_copy(self, planes_ptr: int, num_planes: int, src_ids_ptr: int, dst_ids_ptr: int,
                           num_blocks: int, stream: Stream, max_blocks: int) -> None: ...

    # ---- device memory ---------------------------------------------------------------------------------
    def alloc_device_bytes(self, nbytes: int) -> torch.Tensor: ...
