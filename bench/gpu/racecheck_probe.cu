// Whether compute-sanitizer's racecheck orders shared-memory accesses by a named barrier that one side only arrives
// at: the role split's hand-overs (role_split_backward.cu) are of that form, a role arriving (barrier.arrive) once it
// has read or written a tile and the next user waiting (barrier.sync), which the PTX memory model orders, and
// racecheck reports every such pair there (bench/results/gdn-h100-role-split-racecheck-sites.txt). The first three
// forms move one word a lane between two warps (`both_wait` is the control, where both sides wait); on an H100 none
// reports a hazard, so racecheck does model a two-warp arrive -> sync. `three_roles` is the kernel's shape: two
// reader warps and a writer warp hand a word back and forth over several chunks, the writer arriving at `ready` and
// waiting at `free`, the readers waiting at `ready` and arriving at `free`, each barrier counting all three warps'
// threads. On the GPU machine:
//
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/probe bench/gpu/racecheck_probe.cu
//   for form in read_then_arrive write_then_arrive both_wait three_roles; do
//     compute-sanitizer --tool racecheck --racecheck-report analysis /tmp/probe $form; done
#include <cstdio>
#include <cstring>

namespace {

constexpr int kBarrier = 1, kThreads = 64;  // two warps meet at named barrier 1
constexpr int kReady = 2, kFree = 3, kRoleThreads = 96, kChunks = 4;  // three_roles' barriers, warps and chunks

__device__ __forceinline__ void arrive(int id = kBarrier, int threads = kThreads) {
  asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void wait(int id = kBarrier, int threads = kThreads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
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

// Warp 2 writes chunk j's word and arrives at kReady; warps 0 and 1 wait there, read it, and arrive at kFree, which
// warp 2 waits at before it writes the next chunk's. Every access is ordered; the readers' arrivals for chunk j + 1
// cannot come before the writer's wait of chunk j, as in the role split's hand-overs.
__global__ void three_roles(int* out) {
  __shared__ int word[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int sum = 0;
  for (int j = 0; j < kChunks; ++j) {
    if (warp == 2) {
      if (j > 0) wait(kFree, kRoleThreads);
      word[lane] = j * 32 + lane;
      arrive(kReady, kRoleThreads);
    } else {
      wait(kReady, kRoleThreads);
      sum += word[lane];
      arrive(kFree, kRoleThreads);
    }
  }
  if (warp == 2) wait(kFree, kRoleThreads);  // the last chunk's readers, before the CTA's shared memory goes
  if (warp < 2) out[warp * 32 + lane] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  const struct {
    const char* name;
    void (*kernel)(int*);
    int threads;
  } forms[] = {{"read_then_arrive", read_then_arrive, kThreads},
               {"write_then_arrive", write_then_arrive, kThreads},
               {"both_wait", both_wait, kThreads},
               {"three_roles", three_roles, kRoleThreads}};
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s read_then_arrive|write_then_arrive|both_wait|three_roles\n", argv[0]);
    return 2;
  }
  for (const auto& form : forms) {
    if (std::strcmp(argv[1], form.name) != 0) continue;
    int* out = nullptr;
    if (cudaMalloc(&out, 64 * sizeof(int)) != cudaSuccess) return 1;
    form.kernel<<<1, form.threads>>>(out);
    const cudaError_t status = cudaDeviceSynchronize();
    cudaFree(out);
    std::printf("%s: %s\n", form.name, cudaGetErrorString(status));
    return status == cudaSuccess ? 0 : 1;
  }
  std::fprintf(stderr, "%s: no form '%s' (read_then_arrive, write_then_arrive, both_wait, three_roles)\n", argv[0],
               argv[1]);
  return 2;
}
