/* The byte of five ternary codes (format ternary_base3): what pack writes,
 * what the scalar reference reads, and the rule every SIMD decode matches.
 *
 * Codes c_0..c_4 (each 0..2, level c - 1) make the base-3 number
 * V = sum_j c_j 3^(4-j), 0..242. Negating every level maps V to 242 - V, so
 * the 243 patterns are 121 pairs around V = 121 (all levels zero): a byte
 * keeps the larger of the pair, V' = max(V, 242 - V) in 121..242, and a sign
 * bit (bit 7) for "negate". V' is stored as llama.cpp's TQ1_0 stores its
 * base-3 bytes, q = ceil(V' * 256 / 243), whose digits come out most
 * significant first as the high byte of q * 3 (then q = q * 3 mod 256, and
 * again): one 16-bit multiply per digit, no division. q is 128..255 for
 * V' >= 121, so its top bit is always set and the byte holds q's low 7 bits:
 *   byte = sign << 7 | (q & 0x7f).
 * Decoding is then a 128-entry table per digit on the low 7 bits (AVX-512's
 * vpermi2b), or the multiply on q = byte | 0x80 (AVX2, portable), then
 * c -> 2 - c where the sign bit is set. The all-zero pattern is byte 0, so
 * padding is zeros. Of the 256 bytes, 122 x 2 - 1 are canonical (what
 * pack writes): the others decode to some codes but are refused by
 * ulb_blob_verify and ulb_unpack (ULB_ERR_CODE), so a blob has one meaning. */
#ifndef ULB_BASE3_H
#define ULB_BASE3_H

#include <stdint.h>

#define ULB_BASE3_DIGITS 5 /* codes a byte */
#define ULB_BASE3_ZERO 121 /* V of five zero levels (codes 1) */

/* Digit j (0 = most significant) of the byte b: code 0..2. */
static inline unsigned ulb_base3_code(uint8_t b, int j) {
    unsigned q = (unsigned)b | 0x80u, d = 0;
    for (int i = 0; i <= j; i++) {
        d = (q * 3u) >> 8;
        q = (q * 3u) & 0xffu;
    }
    return b >> 7 ? 2u - d : d;
}

/* The byte of V = sum_j c_j 3^(4-j) (0..242). */
static inline uint8_t ulb_base3_byte(unsigned V) {
    const unsigned neg = V < ULB_BASE3_ZERO, v = neg ? 242u - V : V;
    const unsigned q = (v * 256u + 242u) / 243u;
    return (uint8_t)(neg << 7 | (q & 0x7fu));
}

/* V of the byte b, read back digit by digit. */
static inline unsigned ulb_base3_value(uint8_t b) {
    unsigned V = 0;
    for (int j = 0; j < ULB_BASE3_DIGITS; j++) V = V * 3u + ulb_base3_code(b, j);
    return V;
}

/* Whether pack can have written b. */
static inline int ulb_base3_canonical(uint8_t b) { return ulb_base3_byte(ulb_base3_value(b)) == b; }

#endif
