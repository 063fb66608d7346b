// What the torus asks of CUDA that its device-generic code cannot.
//
// The stream pipeline's watcher thread, before it queries events: the Work's GPU current (a
// query on a thread whose device was never set creates a context on GPU 0, about 0.5 GB, on
// every rank of the node), and thread-local stream-capture mode, so that its queries cannot
// invalidate a CUDA graph another thread is capturing (as ProcessGroupNCCL's watchdog does).
// The thread is the pipeline's own, so the mode is never set back.
//
// Whether the calling thread's current stream on a GPU is capturing a CUDA graph: such an
// allreduce goes to the whole group's NCCL allreduce, which a graph can hold.
//
// An event queried from a caller's thread (the tuner's trials): in thread-local capture mode
// for the query only, then the caller's mode again; in global mode the query would
// invalidate a graph that another thread is capturing.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "torus/algorithm_tuner.h"
#include "torus/stream_pipeline.h"

namespace torch_bigbatch::torus {
namespace {

void prepare_cuda_watcher(c10::Device device) {
  C10_CUDA_CHECK(c10::cuda::SetDevice(device.index()));
  thread_local bool thread_local_capture = [] {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    return true;
  }();
  (void)thread_local_capture;
}

bool cuda_stream_capturing(c10::Device device) {
  const c10::cuda::CUDAGuard on_device(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

bool query_outside_captures(const c10::Event& event) {
  const c10::cuda::CUDAStreamCaptureModeGuard thread_local_mode(
      cudaStreamCaptureModeThreadLocal);
  return event.query();
}

const WatcherSetups::Register kCudaWatcher(c10::DeviceType::CUDA, &prepare_cuda_watcher);
const EventQueries::Register kCudaEventQuery(c10::DeviceType::CUDA, &query_outside_captures);
const CaptureChecks::Register kCudaCapture(c10::DeviceType::CUDA, &cuda_stream_capturing);

}  // namespace
}  // namespace torch_bigbatch::torus
