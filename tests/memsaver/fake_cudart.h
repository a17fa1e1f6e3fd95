#pragma once

extern "C" {

struct FakeCudartCalls {
  int mallocs = 0;
  int frees = 0;
  void* last_freed = nullptr;
};

FakeCudartCalls fake_cudart_calls(void);
}
