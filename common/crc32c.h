// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as in iSCSI and
// ext4), so that `crc32c` from common tools matches; checkpoints carry it for
// every file and data section. Pure functions, safe from any thread.
#ifndef SHARDPS_COMMON_CRC32C_H_
#define SHARDPS_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace shardps {

// Extends `crc` (0 to start) with n bytes. Crc32c(0, "123456789", 9) ==
// 0xE3069283.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

// CRC32C(A || B) from CRC32C(A), CRC32C(B) and |B| (zlib's crc32_combine),
// so that a writer gets a whole file's CRC without reading its data back.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace shardps

#endif  // SHARDPS_COMMON_CRC32C_H_
