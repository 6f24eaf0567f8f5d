// A session's shared secret, and the mutual challenge-response that proves, on every connection between its
// processes, that both ends hold it, without sending it.
//
// The network is not trusted (SECURITY.md): anyone who reaches a port could otherwise claim a rank, be sent
// the stages' code, weights and activations, or send a worker code of their own. So every connection, to the
// store and between ranks, starts with this exchange, before either end reads anything else from it:
//
//   connector -> listener: "LPAUTH01", nonce_c (32 random bytes)
//   listener -> connector: "LPAUTH01", nonce_l, HMAC-SHA256(key, "listener" | purpose | nonce_c | nonce_l)
//   connector -> listener: HMAC-SHA256(key, "connector" | purpose | nonce_c | nonce_l)
//
// Each end checks the other's MAC (in constant time) and drops the connection otherwise. The roles in the MAC
// keep one end's answer from being replayed as the other's; fresh nonces on both sides keep an answer from
// being replayed on another connection; `purpose` binds the answer to what the connection is for (the store,
// or the link between two given ranks). The exchange authenticates; it does not encrypt: what follows
// travels in the clear, and an attacker on the path between two hosts could read or alter it (SECURITY.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/comm/socket.h"

namespace libpipe::comm {

class Secret {
 public:
  // The token given (a C ABI option, --token-file's content), else LIBPIPE_TOKEN's. Throws
  // Error(InvalidArgument) when there is none ("set LIBPIPE_TOKEN on every process ...") or it is shorter
  // than kMinTokenBytes.
  static Secret from(const std::string& token);
  // Whether a token is given or set in the environment.
  static bool available(const std::string& token);

  const std::vector<uint8_t>& key() const { return key_; }

  static constexpr size_t kMinTokenBytes = 16;

 private:
  std::vector<uint8_t> key_;
};

// A fresh random token: 32 bytes as 64 hexadecimal digits (what --processes hands its children).
std::string new_token();

// The exchange above, on a connected socket, bounded by `deadline`. Throws Error(Communication) saying what
// failed (the peer does not speak libpipe, or does not hold the token) without revealing anything else.
void authenticate_as_connector(const Socket& socket, const Secret& secret, const std::string& purpose,
                               Deadline deadline, const std::string& peer);
void authenticate_as_listener(const Socket& socket, const Secret& secret, const std::string& purpose, Deadline deadline,
                              const std::string& peer);

}  // namespace libpipe::comm
