"""CRC-32 algebra: the CRC-32 of joined or cut byte strings from the CRC-32s of their parts.

zip, and so torch.save, stores the CRC-32 (zlib's) of every record's data. A record that
reshard or consolidate builds from whole source records gets its CRC-32 by combining theirs
(`crc32_combine`); one holding part of a source record gets it from the stored CRC-32 and the
CRC-32 of the rest of that record (`crc32_slice`), so only the smaller side is read and summed.

The arithmetic is zlib's (crc32.c since 1.2.12, `multmodp` and `x2nmodp`): a CRC-32 is a
polynomial over GF(2) modulo POLY, appending n bytes multiplies it by x^(8n), and since POLY
is irreducible x^(2^32 - 1) = 1, so x^(-8n) exists and removing a known suffix is a product too.

Example:
    >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
    True
    >>> crc32_slice(zlib.crc32(b"abcd"), zlib.crc32(b"a"), zlib.crc32(b"d"), 2, 1) == zlib.crc32(b"bc")
    True
"""

from __future__ import annotations

POLY = 0xEDB88320  # zlib's CRC-32 polynomial, bit-reflected: bit 31 holds x^0, bit 0 x^31
ONE = 1 << 31  # the polynomial 1
ORDER = (1 << 32) - 1  # x^ORDER = 1 modulo POLY (irreducible of degree 32): exponents wrap around


def _multiply(a: int, b: int) -> int:
    """Return a * b modulo POLY (both bit-reflected)."""
    product, bit = 0, ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return product


def _squares() -> list[int]:
    squares = [ONE >> 1]  # x^1
    for _ in range(31):
        squares.append(_multiply(squares[-1], squares[-1]))
    return squares


_X_TO_2_TO_THE = _squares()  # x^(2^k) modulo POLY, k = 0..31


def _x_power(n: int) -> int:
    """Return x^n modulo POLY, for any integer n (negative: the inverse)."""
    n %= ORDER
    power, k = ONE, 0
    while n:
        if n & 1:
            power = _multiply(_X_TO_2_TO_THE[k], power)
        n >>= 1
        k += 1
    return power


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """Return the CRC-32 of `a + b` from crc32(a), crc32(b) and len(b) (zlib's crc32_combine),
    so a tensor's CRC follows from the CRCs torch.save stored for its chunks."""
    return _multiply(_x_power(8 * length_b), crc_a) ^ crc_b


def crc32_remove_suffix(crc_ab: int, crc_b: int, length_b: int) -> int:
    """Return crc32(a) from crc32(a + b), crc32(b) and len(b)."""
    return _multiply(_x_power(-8 * length_b), crc_ab ^ crc_b)


def crc32_remove_prefix(crc_ab: int, crc_a: int, length_b: int) -> int:
    """Return crc32(b) from crc32(a + b), crc32(a) and len(b)."""
    return crc_ab ^ _multiply(_x_power(8 * length_b), crc_a)


def crc32_slice(crc_whole: int, crc_before: int, crc_after: int, length: int, length_after: int) -> int:
    """Return the CRC-32 of `whole[i:i + length]` from crc32(whole), crc32(whole[:i]),
    crc32(whole[i + length:]) and the lengths of the slice and of what follows it."""
    return crc32_remove_prefix(crc32_remove_suffix(crc_whole, crc_after, length_after), crc_before, length)
