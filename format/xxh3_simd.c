/* xxh3_simd.c: XXH3-64 (seed 0) from Debian's xxhash.h, inlined and compiled
 * once per vector ISA (format/CMakeLists.txt builds it with -mavx2 and with
 * -mavx512f -mavx512bw; xxhash.h picks its AVX2 or AVX-512 loop from those
 * flags). Plain C, and everything in it static but these three functions, so
 * no code built for a wider ISA can leak into the rest of the program; they
 * run only where tensor_hash.cc found the CPU supports it. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#define HSX_CAT2(a, b) a##b
#define HSX_CAT(a, b) HSX_CAT2(a, b)
#define HSX_FN(name) HSX_CAT(HSX_CAT(hsx_xxh3_, HSX_XXH3_BUILD), HSX_CAT(_, name))

size_t HSX_FN(state_size)(void) { return sizeof(XXH3_state_t); }
void HSX_FN(reset)(void* state) { XXH3_64bits_reset((XXH3_state_t*)state); }
void HSX_FN(update)(void* state, const void* bytes, size_t n) { XXH3_64bits_update((XXH3_state_t*)state, bytes, n); }
unsigned long long HSX_FN(digest)(const void* state) { return XXH3_64bits_digest((const XXH3_state_t*)state); }
