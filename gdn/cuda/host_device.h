// DELTATRAIN_HOST_DEVICE: a function both the kernels and the host (its CPU tests, built without nvcc) call.
#pragma once

#ifdef __CUDACC__
#define DELTATRAIN_HOST_DEVICE __host__ __device__
#else
#define DELTATRAIN_HOST_DEVICE
#endif
