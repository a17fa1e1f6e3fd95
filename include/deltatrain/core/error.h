// Errors are types: each maps to one Python exception and one kind of user action.
// Nothing in the library prints or exits; every failure surfaces as one of these.
#pragma once

#include <stdexcept>
#include <string>

namespace deltatrain {

// Base of every error the library throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed something that breaks the contract (maps to Python ValueError).
// The message names the argument, the rule and the actual value.
class InvalidArgument : public Error {
 public:
  InvalidArgument(const std::string& argument, const std::string& rule);
  const std::string& argument() const { return argument_; }
  const std::string& rule() const { return rule_; }

 private:
  std::string argument_, rule_;
};

// A backend or facility cannot serve this call here (maps to Python RuntimeError).
class Unavailable : public Error {
 public:
  Unavailable(const std::string& what, const std::string& reason);
};

// A call into the system or a runtime failed (CUDA, MPI, NCCL, file I/O): names the call and its code.
class Failure : public Error {
 public:
  using Error::Error;
};

// Memory could not be allocated (maps to Python MemoryError). The message names what was being
// allocated and, where known, how much: a bare std::bad_alloc says neither.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A call in the wrong state (pausing a paused region, resuming an active one, ...).
class StateError : public Error {
 public:
  using Error::Error;
};

}  // namespace deltatrain
