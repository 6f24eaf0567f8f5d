#include "runtime/comm/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <array>
#include <cstdlib>
#include <cstring>

#include "runtime/error.h"

namespace libpipe::comm {

namespace {

constexpr char kHello[8] = {'L', 'P', 'A', 'U', 'T', 'H', '0', '1'};
constexpr size_t kNonce = 32, kMac = 32;
using Nonce = std::array<uint8_t, kNonce>;
using Mac = std::array<uint8_t, kMac>;

Nonce random_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw Error(Status::Internal, "no random bytes for a connection's challenge (OpenSSL's RAND_bytes failed)");
  return n;
}

Mac mac(const Secret& secret, const char* role, const std::string& purpose, const Nonce& connector,
        const Nonce& listener) {
  std::string message = role;
  message += '\0';
  message += purpose;
  message += '\0';
  message.append(reinterpret_cast<const char*>(connector.data()), connector.size());
  message.append(reinterpret_cast<const char*>(listener.data()), listener.size());
  Mac out{};
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), secret.key().data(), static_cast<int>(secret.key().size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(), &len) ||
      len != kMac)
    throw Error(Status::Internal, "HMAC-SHA256 failed (OpenSSL)");
  return out;
}

void expect_hello(const Socket& s, Deadline deadline, const std::string& peer) {
  char hello[sizeof kHello];
  s.read_exact(hello, sizeof hello, deadline, peer);
  if (std::memcmp(hello, kHello, sizeof hello) != 0)
    throw Error(Status::Communication, peer + " does not speak libpipe's protocol (or another version of it)");
}

void expect_mac(const Mac& got, const Mac& want, const std::string& peer) {
  if (CRYPTO_memcmp(got.data(), want.data(), kMac) != 0)
    throw Error(Status::Communication,
                peer + " does not hold this session's token: refused (give every process the same LIBPIPE_TOKEN)");
}

}  // namespace

bool Secret::available(const std::string& token) {
  const char* env = std::getenv("LIBPIPE_TOKEN");
  return !token.empty() || (env && *env);
}

Secret Secret::from(const std::string& token) {
  std::string value = token;
  if (value.empty()) {
    const char* env = std::getenv("LIBPIPE_TOKEN");
    if (env) value = env;
  }
  if (value.empty())
    throw Error(Status::InvalidArgument,
                "a session over several processes needs a shared secret, so that no one else can join it: set "
                "LIBPIPE_TOKEN to the same random string (at least 16 bytes; e.g. `openssl rand -hex 32`) for "
                "every process, or give it as the token option (`pipe ... --token-file FILE`)");
  if (value.size() < kMinTokenBytes)
    throw Error(Status::InvalidArgument, "the session's token is " + std::to_string(value.size()) +
                                             " bytes; give at least " + std::to_string(kMinTokenBytes) +
                                             " (e.g. `openssl rand -hex 32`)");
  Secret s;
  s.key_.assign(value.begin(), value.end());
  return s;
}

std::string new_token() {
  const Nonce bytes = random_nonce();
  static const char digits[] = "0123456789abcdef";
  std::string hex;
  for (uint8_t b : bytes) {
    hex += digits[b >> 4];
    hex += digits[b & 15];
  }
  return hex;
}

void authenticate_as_connector(const Socket& s, const Secret& secret, const std::string& purpose, Deadline deadline,
                               const std::string& peer) {
  const Nonce mine = random_nonce();
  std::array<uint8_t, sizeof kHello + kNonce> hello{};
  std::memcpy(hello.data(), kHello, sizeof kHello);
  std::memcpy(hello.data() + sizeof kHello, mine.data(), kNonce);
  s.write_all(hello.data(), hello.size(), deadline, peer);
  expect_hello(s, deadline, peer);
  Nonce theirs{};
  Mac their_mac{};
  s.read_exact(theirs.data(), kNonce, deadline, peer);
  s.read_exact(their_mac.data(), kMac, deadline, peer);
  expect_mac(their_mac, mac(secret, "listener", purpose, mine, theirs), peer);
  const Mac answer = mac(secret, "connector", purpose, mine, theirs);
  s.write_all(answer.data(), kMac, deadline, peer);
}

void authenticate_as_listener(const Socket& s, const Secret& secret, const std::string& purpose, Deadline deadline,
                              const std::string& peer) {
  expect_hello(s, deadline, peer);
  Nonce theirs{};
  s.read_exact(theirs.data(), kNonce, deadline, peer);
  const Nonce mine = random_nonce();
  const Mac proof = mac(secret, "listener", purpose, theirs, mine);
  std::array<uint8_t, sizeof kHello + kNonce + kMac> reply{};
  std::memcpy(reply.data(), kHello, sizeof kHello);
  std::memcpy(reply.data() + sizeof kHello, mine.data(), kNonce);
  std::memcpy(reply.data() + sizeof kHello + kNonce, proof.data(), kMac);
  s.write_all(reply.data(), reply.size(), deadline, peer);
  Mac their_mac{};
  s.read_exact(their_mac.data(), kMac, deadline, peer);
  expect_mac(their_mac, mac(secret, "connector", purpose, theirs, mine), peer);
}

}  // namespace libpipe::comm
