// Whether compute-sanitizer's racecheck orders shared-memory accesses by a named barrier that one side only arrives
// at: the role split's hand-overs (role_split_backward.cu) are of that form, a role arriving (barrier.arrive) once it
// has read or written a tile and the next user waiting (barrier.sync), which the PTX memory model orders, and
// racecheck reports every such pair there (bench/results/gdn-h100-role-split-racecheck-sites.txt). The first three
// forms move one word a lane between two warps (`both_wait` is the control, where both sides wait); on an H100 none
// reports a hazard, so racecheck does model a one-shot two-warp arrive -> sync. The hand-over forms are the kernel's
// shape: reader warps and a writer warp hand a word back and forth over chunks by two barriers. `three_roles` (two
// readers, four chunks), correct by the argument at hand_over, reported hazards on an H100, so racecheck reports some
// correctly ordered hand-overs; `three_roles_once` (two readers, one chunk) is clean and `two_roles_loop` (one reader,
// four chunks) reports them, so what it misreads is the barriers' reuse over chunks, not the second arriving warp.
// On the GPU machine:
//
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/probe bench/gpu/racecheck_probe.cu
//   for form in read_then_arrive write_then_arrive both_wait three_roles three_roles_once two_roles_loop; do
//     compute-sanitizer --tool racecheck --racecheck-report analysis /tmp/probe $form; done
#include <cstdio>
#include <cstring>

namespace {

constexpr int kBarrier = 1, kThreads = 64;  // two warps meet at named barrier 1
constexpr int kReady = 2, kFree = 3;  // hand_over's barriers

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

// The last warp writes chunk j's word and arrives at kReady; the others (the readers) wait there, read it, and arrive
// at kFree, which the writer waits at before it writes the next chunk's. Every access is ordered: a reader's arrival
// for chunk j + 1 cannot come before the writer's wait of chunk j, as in the role split's hand-overs. Both barriers
// count all the block's threads. The forms in main vary the readers and the chunks.
__global__ void hand_over(int* out, int chunks) {
  __shared__ int word[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, writer = blockDim.x / 32 - 1;
  int sum = 0;
  for (int j = 0; j < chunks; ++j) {
    if (warp == writer) {
      if (j > 0) wait(kFree, blockDim.x);
      word[lane] = j * 32 + lane;
      arrive(kReady, blockDim.x);
    } else {
      wait(kReady, blockDim.x);
      sum += word[lane];
      arrive(kFree, blockDim.x);
    }
  }
  if (warp == writer) wait(kFree, blockDim.x);  // the last chunk's readers, before the CTA's shared memory goes
  if (warp != writer) out[warp * 32 + lane] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  // A two-warp form runs its kernel; a hand-over form runs hand_over with `readers` reader warps over `chunks`.
  const struct {
    const char* name;
    void (*kernel)(int*);
    int readers, chunks;
  } forms[] = {{"read_then_arrive", read_then_arrive, 1, 1},
               {"write_then_arrive", write_then_arrive, 1, 1},
               {"both_wait", both_wait, 1, 1},
               {"three_roles", nullptr, 2, 4},
               {"three_roles_once", nullptr, 2, 1},
               {"two_roles_loop", nullptr, 1, 4}};
  constexpr const char* kNames =
      "read_then_arrive|write_then_arrive|both_wait|three_roles|three_roles_once|two_roles_loop";
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s %s\n", argv[0], kNames);
    return 2;
  }
  for (const auto& form : forms) {
    if (std::strcmp(argv[1], form.name) != 0) continue;
    int* out = nullptr;
    if (cudaMalloc(&out, 64 * sizeof(int)) != cudaSuccess) return 1;
    const int threads = 32 * (form.readers + 1);
    if (form.kernel) {
      form.kernel<<<1, threads>>>(out);
    } else {
      hand_over<<<1, threads>>>(out, form.chunks);
    }
    const cudaError_t status = cudaDeviceSynchronize();
    cudaFree(out);
    std::printf("%s: %s\n", form.name, cudaGetErrorString(status));
    return status == cudaSuccess ? 0 : 1;
  }
  std::fprintf(stderr, "%s: no form '%s' (%s)\n", argv[0], argv[1], kNames);
  return 2;
}
