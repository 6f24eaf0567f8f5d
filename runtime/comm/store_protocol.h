// The requests of libpipe's rendezvous store (store_server.h, store_client.h), after a connection has
// authenticated (auth.h). One request at a time per connection, each answered before the next:
//
//   request:  u8 op, then its fields;  key: u32 length + bytes;  value: u64 length + bytes;  ints: i64
//   Set(key, value) -> u8 0                     Get(key, timeout ms) -> u8 0 + value | u8 1 (timed out)
//   Add(key, delta) -> i64 new value            Check(u32 n, keys) -> u8 all present
//   Wait(u32 n, keys, timeout ms) -> u8 0 | 1   Delete(key) -> u8 deleted      NumKeys -> i64
//   CompareSet(key, expected value, desired value) -> value (the one stored afterwards)
//
// Integers are little-endian. The server bounds every size before it allocates (kMaxKeyBytes,
// kMaxValueBytes, kMaxKeysPerRequest, and the store's totals) and closes a connection that breaks a bound or
// sends an unknown request.
#pragma once

#include <cstdint>

namespace libpipe::comm::store {

enum Op : uint8_t { Set = 1, Get = 2, Add = 3, Check = 4, Wait = 5, Delete = 6, NumKeys = 7, CompareSet = 8 };

constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint64_t kMaxValueBytes = uint64_t{16} << 20;
constexpr uint32_t kMaxKeysPerRequest = 4096;
constexpr uint64_t kMaxEntries = uint64_t{1} << 20;
constexpr uint64_t kMaxStoredBytes = uint64_t{256} << 20;

// The purpose an authenticated store connection is bound to (auth.h).
constexpr const char* kPurpose = "libpipe-store-1";

}  // namespace libpipe::comm::store
