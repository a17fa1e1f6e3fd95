#include "deltatrain/core/error.h"

namespace deltatrain {

InvalidArgument::InvalidArgument(const std::string& argument, const std::string& rule)
    : Error("invalid argument '" + argument + "': " + rule), argument_(argument), rule_(rule) {}

Unavailable::Unavailable(const std::string& what, const std::string& reason)
    : Error(what + " is unavailable: " + reason) {}

}  // namespace deltatrain
