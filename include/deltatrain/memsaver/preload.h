/* The C interface of the LD_PRELOAD shim (libdeltatrain_memsaver_preload.so), which deltatrain/memsaver.py
 * drives through ctypes. The shim defines cudaMalloc and cudaFree: while the calling thread is inside a region,
 * cudaMalloc allocates from one process-wide Saver; cudaFree gives back the saver's allocations and forwards
 * every other pointer to the real cudaFree (found with dlsym(RTLD_NEXT)).
 *
 * Environment, read when the saver is first needed:
 *   DELTATRAIN_MEMSAVER_BACKEND  "cuda" (default) or "host" (host pages: lets the routing be tested without a GPU)
 *   DELTATRAIN_MEMSAVER_REGION   "tag" or "tag:backup": the region of threads that opened none (for example
 *                                autograd's worker threads), so that a whole process can allocate through the saver
 * The saver serves one device: the current one when it is created. Every function returns a status; on
 * failure deltatrain_memsaver_last_error() holds the message for the calling thread. */
#ifndef DELTATRAIN_MEMSAVER_PRELOAD_H
#define DELTATRAIN_MEMSAVER_PRELOAD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DELTATRAIN_MEMSAVER_ABI_VERSION 1
#define DELTATRAIN_MEMSAVER_TAG_CAPACITY 128 /* tags are at most 127 bytes */

enum deltatrain_memsaver_status {
  DELTATRAIN_MEMSAVER_OK = 0,
  DELTATRAIN_MEMSAVER_INVALID_ARGUMENT = 1,
  DELTATRAIN_MEMSAVER_STATE_ERROR = 2,
  DELTATRAIN_MEMSAVER_UNAVAILABLE = 3,
  DELTATRAIN_MEMSAVER_FAILURE = 4,
  DELTATRAIN_MEMSAVER_OUT_OF_MEMORY = 5,
};

/* The order of deltatrain::memsaver::Backup and TagState. */
enum deltatrain_memsaver_backup { DELTATRAIN_MEMSAVER_NONE = 0, DELTATRAIN_MEMSAVER_CPU = 1, DELTATRAIN_MEMSAVER_RESTORE_FROM = 2 };

typedef struct {
  char tag[DELTATRAIN_MEMSAVER_TAG_CAPACITY];
  int32_t backup; /* deltatrain_memsaver_backup */
  int32_t paused; /* 0 active, 1 paused */
  uint64_t allocations;
  uint64_t bytes;
  uint64_t reserved_bytes;
  uint64_t mapped_bytes;
  uint64_t backup_bytes;
  uint64_t host_bytes_held;
} deltatrain_memsaver_tag_stats;

int deltatrain_memsaver_abi_version(void);
/* Opens a region on the calling thread (regions nest). A null tag opens a scope whose allocations bypass the
 * saver (buffers that must never move, such as ones shared through cudaIpc). Creates the saver if needed. */
int deltatrain_memsaver_region_enter(const char* tag, int backup);
int deltatrain_memsaver_region_exit(void);
/* A null tag means every tag. */
int deltatrain_memsaver_pause(const char* tag);
int deltatrain_memsaver_resume(const char* tag);
/* Segment i: resume copies bytes[i] from host address host[i] to device address device[i]. */
int deltatrain_memsaver_register_backup(const char* tag, const uint64_t* device, const uint64_t* host,
                                        const uint64_t* bytes, uint64_t count);
int deltatrain_memsaver_unregister_backup(const char* tag);
/* Writes at most `capacity` entries, sorted by tag; *count receives the number of tags. */
int deltatrain_memsaver_stats(deltatrain_memsaver_tag_stats* out, int capacity, int* count);
/* PhysicalMemory::device_bytes_in_use of the saver's backend. */
int deltatrain_memsaver_device_bytes_in_use(uint64_t* bytes);
const char* deltatrain_memsaver_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
