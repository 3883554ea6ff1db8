/*
 * binpipe_ref.c -- an independent reference reader and writer for BinPipe version 1.
 *
 * Written from docs/binpipe-format.md only: it shares no code with the Python
 * codec and has its own CRC-32 (no zlib), so the conformance tests in
 * tests/binpipe/test_format_c.py check the document as much as either program.
 *
 *   binpipe_ref encode            < records.txt  > stream.bin
 *   binpipe_ref decode [MAXBYTES] < stream.bin   > records.txt
 *
 * The text form, one item per line (tokens separated by single spaces):
 *
 *   BLOCK <kind> <n_records> <flags>   kind is DATA or META; flags 0 or 1 (payload CRC)
 *   R <n_fields>                       one record; its fields follow, one per line
 *   N                                  NONE
 *   B <hex>                            BYTES, lower-case hex, "-" when empty
 *   S <hex>                            STR, its UTF-8 bytes in hex, "-" when empty
 *   I <decimal>                        INT, signed 64-bit
 *   F <16 hex digits>                  FLOAT, the IEEE-754 bit pattern as a u64
 *   END <count>                        the END block and the count it carries
 *
 * `decode` prints that form for a valid stream and exits 0.  For an invalid stream
 * it prints "binpipe_ref: <reason> at offset <n>" on stderr and exits 1; what it
 * printed on stdout before is then meaningless.  `encode` writes exactly what it is
 * told (END count included, and no END block at all if the input has no END line),
 * so tests can make both valid and deliberately broken streams.
 */

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STREAM_HEADER = 16, BLOCK_HEADER = 40 };
enum { KIND_DATA = 0, KIND_META = 1, KIND_END = 2 };
enum { T_NONE = 0, T_BYTES = 1, T_STR = 2, T_INT = 3, T_FLOAT = 4 };

static const uint8_t STREAM_MAGIC[8] = {0x89, 'A', 'D', 'B', 'P', '\r', '\n', 0x1a};
static const uint8_t BLOCK_MAGIC[4] = {'B', 'P', 'B', 'K'};

/* ---------------------------------------------------------------- CRC-32 */

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, uint64_t n) {
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* ------------------------------------------------------- little endian */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }
static void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void wr64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t pad8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

/* --------------------------------------------------------------- errors */

static __attribute__((noreturn, format(printf, 2, 3))) void fail(uint64_t offset, const char *fmt, ...) {
    va_list ap;
    fputs("binpipe_ref: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " at offset %llu\n", (unsigned long long)offset);
    exit(1);
}

static __attribute__((noreturn)) void die(const char *msg) {
    fprintf(stderr, "binpipe_ref: %s\n", msg);
    exit(2);
}

/* ------------------------------------------------------ growable buffer */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf_t;

static void buf_reserve(buf_t *b, size_t extra) {
    if (b->n + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + extra) cap *= 2;
    b->p = realloc(b->p, cap);
    if (!b->p) die("out of memory");
    b->cap = cap;
}

static void buf_put(buf_t *b, const void *src, size_t n) {
    buf_reserve(b, n);
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void buf_zeros(buf_t *b, size_t n) {
    buf_reserve(b, n);
    memset(b->p + b->n, 0, n);
    b->n += n;
}

/* =============================================================== decode */

static int valid_utf8(const uint8_t *s, uint64_t n) {
    uint64_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        int len;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c == 0xE0) { len = 3; lo = 0xA0; }
        else if (c == 0xED) { len = 3; hi = 0x9F; }
        else if (c >= 0xE1 && c <= 0xEF) len = 3;
        else if (c == 0xF0) { len = 4; lo = 0x90; }
        else if (c == 0xF4) { len = 4; hi = 0x8F; }
        else if (c >= 0xF1 && c <= 0xF3) len = 4;
        else return 0;
        if (n - i < (uint64_t)len) return 0;
        if (s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (uint64_t k = 2; k < (uint64_t)len; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return 0;
        i += (uint64_t)len;
    }
    return 1;
}

static void print_hex(const uint8_t *p, uint64_t n) {
    static const char digits[] = "0123456789abcdef";
    if (n == 0) { fputs("-", stdout); return; }
    char chunk[8192];
    size_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        chunk[k++] = digits[p[i] >> 4];
        chunk[k++] = digits[p[i] & 15];
        if (k == sizeof chunk) { fwrite(chunk, 1, k, stdout); k = 0; }
    }
    fwrite(chunk, 1, k, stdout);
}

static uint8_t *read_all(FILE *f, uint64_t *len) {
    buf_t b = {0};
    for (;;) {
        buf_reserve(&b, 1 << 16);
        size_t got = fread(b.p + b.n, 1, b.cap - b.n, f);
        b.n += got;
        if (got == 0) break;
    }
    *len = b.n;
    return b.p;
}

static int decode(uint64_t max_block) {
    uint64_t len;
    uint8_t *s = read_all(stdin, &len);

    if (len < STREAM_HEADER) fail(0, "truncated stream header (%llu of 16 bytes)", (unsigned long long)len);
    if (memcmp(s, STREAM_MAGIC, 8) != 0) fail(0, "bad stream magic");
    if (crc32_update(0, s, 12) != rd32(s + 12)) fail(0, "stream header CRC mismatch");
    if (rd16(s + 8) != 1) fail(0, "unsupported version %u", rd16(s + 8));
    if (rd16(s + 10) != 0) fail(0, "unsupported stream flags %#x", rd16(s + 10));

    uint64_t pos = STREAM_HEADER, count = 0;
    for (;;) {
        if (pos == len) fail(pos, "truncated stream: no END block");
        if (len - pos < BLOCK_HEADER) fail(pos, "truncated block header");
        const uint8_t *h = s + pos;
        if (memcmp(h, BLOCK_MAGIC, 4) != 0) fail(pos, "bad block magic");
        if (crc32_update(0, h, 36) != rd32(h + 36)) fail(pos, "block header CRC mismatch");
        uint16_t kind = rd16(h + 4), flags = rd16(h + 6);
        uint32_t nrec = rd32(h + 8), nfld = rd32(h + 12);
        uint64_t plen = rd64(h + 16);
        uint32_t tcrc = rd32(h + 24), pcrc = rd32(h + 28);
        if (kind > KIND_END) fail(pos, "unknown block kind %u", kind);
        if (flags & ~1u) fail(pos, "unknown block flags %#x", flags);
        if (rd32(h + 32) != 0) fail(pos, "reserved word is not zero");

        /* The tables are under 2**37 bytes; a hostile payload_len must not wrap the sum. */
        uint64_t tsize = 8ull * nfld + pad8(4ull * nrec) + pad8(nfld);
        if (plen > UINT64_MAX - 8 - BLOCK_HEADER - tsize)
            fail(pos, "block claims more than %llu bytes", (unsigned long long)max_block);
        uint64_t size = BLOCK_HEADER + tsize + pad8(plen);
        if (size > max_block) fail(pos, "block claims more than %llu bytes", (unsigned long long)max_block);
        if (size > len - pos) fail(pos, "truncated block");

        const uint8_t *t = h + BLOCK_HEADER;
        if (crc32_update(0, t, tsize) != tcrc) fail(pos + BLOCK_HEADER, "tables CRC mismatch");
        const uint8_t *fe = t;
        const uint8_t *re = t + 8ull * nfld;
        const uint8_t *ty = re + pad8(4ull * nrec);
        const uint8_t *pl = t + tsize;

        if (nfld == 0) {
            if (plen != 0) fail(pos, "payload without fields");
        } else {
            if (rd64(fe + 8ull * (nfld - 1)) != plen) fail(pos, "field offsets do not end at payload_len");
            uint64_t prev = 0;
            for (uint32_t j = 0; j < nfld; j++) {
                uint64_t e = rd64(fe + 8ull * j);
                if (e < prev) fail(pos, "field offsets go backwards");
                prev = e;
            }
            prev = 0;
            for (uint32_t j = 0; j < nfld; j++) {
                if (ty[j] > T_FLOAT) fail(pos, "unknown field type %u", ty[j]);
            }
            for (uint32_t j = 0; j < nfld; j++) {
                uint64_t e = rd64(fe + 8ull * j), l = e - prev;
                prev = e;
                if ((ty[j] == T_INT || ty[j] == T_FLOAT) && l != 8) fail(pos, "numeric field not 8 bytes");
                if (ty[j] == T_NONE && l != 0) fail(pos, "null field with bytes");
            }
        }
        if (nrec == 0) {
            if (nfld != 0) fail(pos, "fields without records");
        } else {
            if (rd32(re + 4ull * (nrec - 1)) != nfld) fail(pos, "record table does not end at n_fields");
            uint32_t prev = 0;
            for (uint32_t i = 0; i < nrec; i++) {
                uint32_t e = rd32(re + 4ull * i);
                if (e < prev) fail(pos, "record table goes backwards");
                prev = e;
            }
        }
        if ((flags & 1) && crc32_update(0, pl, plen) != pcrc)
            fail(pos + BLOCK_HEADER + tsize, "payload CRC mismatch");
        for (const uint8_t *q = re + 4ull * nrec; q < ty; q++)
            if (*q) fail(pos, "non-zero padding");
        for (const uint8_t *q = ty + nfld; q < pl; q++)
            if (*q) fail(pos, "non-zero padding");
        for (const uint8_t *q = pl + plen; q < h + size; q++)
            if (*q) fail(pos, "non-zero padding");
        for (uint32_t j = 0; j < nfld; j++) {
            uint64_t a = j ? rd64(fe + 8ull * (j - 1)) : 0, b = rd64(fe + 8ull * j);
            if (ty[j] == T_STR && !valid_utf8(pl + a, b - a))
                fail(pos + BLOCK_HEADER + tsize + a, "STR field is not valid UTF-8");
        }

        if (kind == KIND_END) {
            if (nrec != 1 || nfld != 1 || ty[0] != T_INT) fail(pos, "END block is not one INT record");
            int64_t declared = (int64_t)rd64(pl);
            if (declared < 0 || (uint64_t)declared != count)
                fail(pos, "END declares %lld records, stream held %llu", (long long)declared,
                     (unsigned long long)count);
            pos += size;
            if (pos != len) fail(pos, "trailing bytes after END");
            printf("END %lld\n", (long long)declared);
            break;
        }

        printf("BLOCK %s %u %u\n", kind == KIND_DATA ? "DATA" : "META", nrec, flags);
        uint32_t first = 0;
        for (uint32_t i = 0; i < nrec; i++) {
            uint32_t last = rd32(re + 4ull * i);
            printf("R %u\n", last - first);
            for (uint32_t j = first; j < last; j++) {
                uint64_t a = j ? rd64(fe + 8ull * (j - 1)) : 0, b = rd64(fe + 8ull * j);
                switch (ty[j]) {
                    case T_NONE: puts("N"); break;
                    case T_BYTES: fputs("B ", stdout); print_hex(pl + a, b - a); putchar('\n'); break;
                    case T_STR: fputs("S ", stdout); print_hex(pl + a, b - a); putchar('\n'); break;
                    case T_INT: printf("I %lld\n", (long long)(int64_t)rd64(pl + a)); break;
                    default: printf("F %016llx\n", (unsigned long long)rd64(pl + a)); break;
                }
            }
            first = last;
        }
        count += nrec;
        pos += size;
    }
    if (fflush(stdout) != 0) die("write error");
    free(s);
    return 0;
}

/* =============================================================== encode */

/* Reads one whitespace-delimited token into *tok; returns 0 at end of input. */
static int next_token(buf_t *tok) {
    int c;
    tok->n = 0;
    do c = getchar(); while (c == ' ' || c == '\n' || c == '\r' || c == '\t');
    if (c == EOF) return 0;
    while (c != EOF && c != ' ' && c != '\n' && c != '\r' && c != '\t') {
        uint8_t ch = (uint8_t)c;
        buf_put(tok, &ch, 1);
        c = getchar();
    }
    buf_put(tok, "", 1);
    tok->n--;
    return 1;
}

static int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void put_hex(buf_t *out, const buf_t *tok) {
    if (tok->n == 1 && tok->p[0] == '-') return;
    if (tok->n % 2) die("odd-length hex token");
    buf_reserve(out, tok->n / 2);
    for (size_t i = 0; i < tok->n; i += 2) {
        int hi = hexval(tok->p[i]), lo = hexval(tok->p[i + 1]);
        if (hi < 0 || lo < 0) die("bad hex digit");
        out->p[out->n++] = (uint8_t)(hi << 4 | lo);
    }
}

static uint64_t parse_u64(const buf_t *tok, int base) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull((const char *)tok->p, &end, base);
    if (errno || *end || tok->n == 0) die("bad number");
    return v;
}

static int64_t parse_i64(const buf_t *tok) {
    char *end;
    errno = 0;
    long long v = strtoll((const char *)tok->p, &end, 10);
    if (errno || *end || tok->n == 0) die("bad integer");
    return v;
}

static void write_out(const void *p, size_t n) {
    if (n && fwrite(p, 1, n, stdout) != n) die("write error");
}

/* One block's tables and payload, written by emit_block. */
typedef struct {
    buf_t field_ends, record_ends, types, payload;
    uint32_t nrec, nfld;
} block_t;

static void emit_block(block_t *b, uint16_t kind, uint16_t flags) {
    buf_t tables = {0};
    buf_put(&tables, b->field_ends.p, b->field_ends.n);
    buf_put(&tables, b->record_ends.p, b->record_ends.n);
    buf_zeros(&tables, pad8(b->record_ends.n) - b->record_ends.n);
    buf_put(&tables, b->types.p, b->types.n);
    buf_zeros(&tables, pad8(b->types.n) - b->types.n);

    uint8_t h[BLOCK_HEADER];
    memcpy(h, BLOCK_MAGIC, 4);
    wr16(h + 4, kind);
    wr16(h + 6, flags);
    wr32(h + 8, b->nrec);
    wr32(h + 12, b->nfld);
    wr64(h + 16, b->payload.n);
    wr32(h + 24, crc32_update(0, tables.p, tables.n));
    wr32(h + 28, (flags & 1) ? crc32_update(0, b->payload.p, b->payload.n) : 0);
    wr32(h + 32, 0);
    wr32(h + 36, crc32_update(0, h, 36));

    static const uint8_t zeros[8] = {0};
    write_out(h, sizeof h);
    write_out(tables.p, tables.n);
    write_out(b->payload.p, b->payload.n);
    write_out(zeros, pad8(b->payload.n) - b->payload.n);
    free(tables.p);
    b->field_ends.n = b->record_ends.n = b->types.n = b->payload.n = 0;
    b->nrec = b->nfld = 0;
}

static void add_field(block_t *b, uint8_t type) {
    uint8_t e[8];
    wr64(e, b->payload.n);
    buf_put(&b->field_ends, e, 8);
    buf_put(&b->types, &type, 1);
    b->nfld++;
}

static int encode(void) {
    buf_t tok = {0};
    block_t b = {0};

    uint8_t sh[STREAM_HEADER];
    memcpy(sh, STREAM_MAGIC, 8);
    wr16(sh + 8, 1);
    wr16(sh + 10, 0);
    wr32(sh + 12, crc32_update(0, sh, 12));
    write_out(sh, sizeof sh);

    while (next_token(&tok)) {
        if (strcmp((char *)tok.p, "END") == 0) {
            if (!next_token(&tok)) die("END needs a count");
            uint8_t v[8];
            wr64(v, (uint64_t)parse_i64(&tok));
            buf_put(&b.payload, v, 8);
            add_field(&b, T_INT);
            uint8_t r[4];
            wr32(r, 1);
            buf_put(&b.record_ends, r, 4);
            b.nrec = 1;
            emit_block(&b, KIND_END, 0);
            break;
        }
        if (strcmp((char *)tok.p, "BLOCK") != 0) die("expected BLOCK or END");
        uint16_t kind;
        if (!next_token(&tok)) die("BLOCK needs a kind");
        if (strcmp((char *)tok.p, "DATA") == 0) kind = KIND_DATA;
        else if (strcmp((char *)tok.p, "META") == 0) kind = KIND_META;
        else die("BLOCK kind is DATA or META");
        if (!next_token(&tok)) die("BLOCK needs a record count");
        uint64_t nrec = parse_u64(&tok, 10);
        if (!next_token(&tok)) die("BLOCK needs flags");
        uint16_t flags = (uint16_t)parse_u64(&tok, 10);

        for (uint64_t i = 0; i < nrec; i++) {
            if (!next_token(&tok) || strcmp((char *)tok.p, "R") != 0) die("expected R");
            if (!next_token(&tok)) die("R needs a field count");
            uint64_t nf = parse_u64(&tok, 10);
            for (uint64_t j = 0; j < nf; j++) {
                if (!next_token(&tok) || tok.n != 1) die("expected a field tag");
                uint8_t tag = tok.p[0], v[8];
                switch (tag) {
                    case 'N':
                        add_field(&b, T_NONE);
                        break;
                    case 'B':
                    case 'S':
                        if (!next_token(&tok)) die("missing hex");
                        put_hex(&b.payload, &tok);
                        add_field(&b, tag == 'B' ? T_BYTES : T_STR);
                        break;
                    case 'I':
                        if (!next_token(&tok)) die("missing integer");
                        wr64(v, (uint64_t)parse_i64(&tok));
                        buf_put(&b.payload, v, 8);
                        add_field(&b, T_INT);
                        break;
                    case 'F':
                        if (!next_token(&tok)) die("missing float bits");
                        wr64(v, parse_u64(&tok, 16));
                        buf_put(&b.payload, v, 8);
                        add_field(&b, T_FLOAT);
                        break;
                    default:
                        die("unknown field tag");
                }
            }
            uint8_t r[4];
            wr32(r, b.nfld);
            buf_put(&b.record_ends, r, 4);
            b.nrec++;
        }
        emit_block(&b, kind, flags);
    }
    if (fflush(stdout) != 0) die("write error");
    return 0;
}

int main(int argc, char **argv) {
    crc_init();
    if (argc >= 2 && strcmp(argv[1], "encode") == 0 && argc == 2) return encode();
    if (argc >= 2 && strcmp(argv[1], "decode") == 0 && argc <= 3) {
        uint64_t max_block = 1ull << 30;
        if (argc == 3) {
            char *end;
            max_block = strtoull(argv[2], &end, 10);
            if (*end) die("MAXBYTES must be a decimal number");
        }
        return decode(max_block);
    }
    fputs("usage: binpipe_ref encode < records.txt > stream.bin\n"
          "       binpipe_ref decode [MAXBYTES] < stream.bin > records.txt\n",
          stderr);
    return 2;
}
