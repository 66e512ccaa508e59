#include "common/crc32c.h"

#include <cstring>

namespace shardps {
namespace {

constexpr uint32_t kCrc32cPoly = 0x82F63B78;  // reflected Castagnoli

// Slicing-by-8 tables: t[0] is the byte-at-a-time table, t[s][b] is the CRC
// of byte b followed by s zero bytes.
struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kCrc32cPoly : 0);
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int s = 1; s < 8; ++s) {
        t[s][b] = (t[s - 1][b] >> 8) ^ t[0][t[s - 1][b] & 0xff];
      }
    }
  }
};

// a * b modulo the CRC polynomial, in the reflected bit order (bit 31 is x^0).
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = uint32_t{1} << 31;
  uint32_t p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return p;
}

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  static const Crc32cTables* const tables = new Crc32cTables();
  const auto& t = tables->t;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian host, as safetensors assumes
    w ^= crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
          t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^
          t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
  }
  for (; n > 0; ++p, --n) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xff];
  return ~crc;
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  uint32_t x8n = uint32_t{1} << 31;  // x^(8 * len_b), built by squaring x^8
  for (uint32_t sq = uint32_t{1} << 23; len_b != 0; len_b >>= 1) {
    if (len_b & 1) x8n = MultModP(sq, x8n);
    sq = MultModP(sq, sq);
  }
  return MultModP(x8n, crc_a) ^ crc_b;
}

}  // namespace shardps
