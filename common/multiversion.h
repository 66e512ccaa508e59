// SHARDPS_MULTIVERSIONED: compiles a hot loop for AVX-512, AVX2 and
// baseline x86-64 and picks one at load time. Callers keep every version
// bitwise identical: IEEE-exact operations only, and -ffp-contract=off.
#ifndef SHARDPS_COMMON_MULTIVERSION_H_
#define SHARDPS_COMMON_MULTIVERSION_H_

// ThreadSanitizer's runtime is not up yet when the loader runs ifunc
// resolvers, so its builds use the baseline version only.
#if defined(__SANITIZE_THREAD__)
#define SHARDPS_MULTIVERSIONED
#else
#define SHARDPS_MULTIVERSIONED \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

#endif  // SHARDPS_COMMON_MULTIVERSION_H_
