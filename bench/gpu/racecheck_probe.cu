// Whether compute-sanitizer's racecheck orders shared-memory accesses by a named barrier that one side only arrives
// at: the role split's hand-overs (role_split_backward.cu) are of that form, a role arriving (barrier.arrive) once it
// has read or written a tile and the next user waiting (barrier.sync), which the PTX memory model orders, and
// racecheck reports every such pair there (bench/results/gdn-h100-role-split-racecheck-sites.txt). Each hand-over
// below moves one word a lane between two warps; `both_wait` is the control, where both sides wait. On the GPU machine:
//
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/probe bench/gpu/racecheck_probe.cu
//   for form in read_then_arrive write_then_arrive both_wait; do
//     compute-sanitizer --tool racecheck --racecheck-report analysis /tmp/probe $form; done
//
// A hazard on an arrive form and none on the control means racecheck does not model the arrive's release.
#include <cstdio>
#include <cstring>

namespace {

constexpr int kBarrier = 1, kThreads = 64;  // two warps meet at named barrier 1

__device__ __forceinline__ void arrive() {
  asm volatile("barrier.arrive %0, %1;" ::"r"(kBarrier), "r"(kThreads) : "memory");
}
__device__ __forceinline__ void wait() {
  asm volatile("barrier.sync %0, %1;" ::"r"(kBarrier), "r"(kThreads) : "memory");
}

// Warp 0 reads its word, then arrives; warp 1 waits, then overwrites it (a write after read).
__global__ void read_then_arrive(int* out) {
  __shared__ int word[32];
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) word[lane] = lane;
  __syncthreads();
  if (threadIdx.x < 32) {
    out[lane] = word[lane];
    arrive();
  } else {
    wait();
    word[lane] = -lane;
  }
}

// Warp 0 writes its word, then arrives; warp 1 waits, then reads it (a read after write).
__global__ void write_then_arrive(int* out) {
  __shared__ int word[32];
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) {
    word[lane] = lane;
    arrive();
  } else {
    wait();
    out[lane] = word[lane];
  }
}

// The control: both warps wait at the barrier between the write and the read.
__global__ void both_wait(int* out) {
  __shared__ int word[32];
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) word[lane] = lane;
  wait();
  if (threadIdx.x >= 32) out[lane] = word[lane];
}

}  // namespace

int main(int argc, char** argv) {
  const struct {
    const char* name;
    void (*kernel)(int*);
  } forms[] = {{"read_then_arrive", read_then_arrive},
               {"write_then_arrive", write_then_arrive},
               {"both_wait", both_wait}};
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s read_then_arrive|write_then_arrive|both_wait\n", argv[0]);
    return 2;
  }
  for (const auto& form : forms) {
    if (std::strcmp(argv[1], form.name) != 0) continue;
    int* out = nullptr;
    if (cudaMalloc(&out, 32 * sizeof(int)) != cudaSuccess) return 1;
    form.kernel<<<1, kThreads>>>(out);
    const cudaError_t status = cudaDeviceSynchronize();
    cudaFree(out);
    std::printf("%s: %s\n", form.name, cudaGetErrorString(status));
    return status == cudaSuccess ? 0 : 1;
  }
  std::fprintf(stderr, "%s: no form '%s' (read_then_arrive, write_then_arrive, both_wait)\n", argv[0], argv[1]);
  return 2;
}
