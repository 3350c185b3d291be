/* The single-key request header and its usual reply in msgpack, as msgpack-python
   packs and reads them (use_bin_type): shared by kvshm.zmq_ctrl._zmqc (the client on
   libzmq) and kvshm.zmq_ctrl._zmtp (the client speaking ZMTP itself); tests compare
   their bytes with protocol.encode_request. Included by the generated C of both. */
#ifndef KVSHM_KVONE_H
#define KVSHM_KVONE_H
#include <stddef.h>
#include <string.h>

typedef unsigned long long kv_u64;
static unsigned char *kv_mp_uint(unsigned char *p, kv_u64 v) {
    if (v < 0x80) { *p++ = (unsigned char)v; }
    else if (v <= 0xff) { *p++ = 0xcc; *p++ = (unsigned char)v; }
    else if (v <= 0xffff) { *p++ = 0xcd; *p++ = v >> 8; *p++ = v; }
    else if (v <= 0xffffffffULL) { *p++ = 0xce; *p++ = v >> 24; *p++ = v >> 16;
                                   *p++ = v >> 8; *p++ = v; }
    else { int i; *p++ = 0xcf; for (i = 7; i >= 0; i--) *p++ = v >> (8 * i); }
    return p;
}
/* [2, op, rid, epoch, {"keys": [key], ("sums": [sum],) "sizes": [size], "counts": [1]}]
   (put) or [2, op, rid, epoch, {"keys": [key]}]: as msgpack-python packs them
   (use_bin_type). buf holds klen + 80 bytes. Returns the length. */
static size_t kv_encode1(unsigned char *buf, int op, kv_u64 rid, kv_u64 epoch,
                         const char *key, size_t klen, int put, kv_u64 size,
                         int has_sum, kv_u64 sum) {
    unsigned char *p = buf;
    *p++ = 0x95; *p++ = 0x02; *p++ = (unsigned char)op;
    p = kv_mp_uint(p, rid);
    p = kv_mp_uint(p, epoch);
    *p++ = put ? (has_sum ? 0x84 : 0x83) : 0x81;
    *p++ = 0xa4; memcpy(p, "keys", 4); p += 4; *p++ = 0x91;
    if (klen <= 0xff) { *p++ = 0xc4; *p++ = klen; }
    else if (klen <= 0xffff) { *p++ = 0xc5; *p++ = klen >> 8; *p++ = klen; }
    else { *p++ = 0xc6; *p++ = klen >> 24; *p++ = klen >> 16; *p++ = klen >> 8;
           *p++ = klen; }
    memcpy(p, key, klen); p += klen;
    if (put) {
        if (has_sum) { *p++ = 0xa4; memcpy(p, "sums", 4); p += 4; *p++ = 0x91;
                       p = kv_mp_uint(p, sum); }
        *p++ = 0xa5; memcpy(p, "sizes", 5); p += 5; *p++ = 0x91;
        p = kv_mp_uint(p, size);
        *p++ = 0xa6; memcpy(p, "counts", 6); p += 6; *p++ = 0x91; *p++ = 0x01;
    }
    return (size_t)(p - buf);
}
/* msgpack reading, only the forms the usual replies use; 0: not that form */
typedef struct { const unsigned char *p, *end; } kv_rd;
static int kv_rd_int(kv_rd *r, long long *out) {
    const unsigned char *p = r->p;
    kv_u64 v = 0; int n = 0, i;
    if (p >= r->end) return 0;
    unsigned char c = *p++;
    if (c < 0x80) { *out = c; r->p = p; return 1; }
    if (c >= 0xe0) { *out = (signed char)c; r->p = p; return 1; }
    if (c == 0xd0) { if (p + 1 > r->end) return 0; *out = (signed char)p[0]; r->p = p + 1; return 1; }
    switch (c) { case 0xcc: n = 1; break; case 0xcd: n = 2; break;
                 case 0xce: n = 4; break; case 0xcf: n = 8; break; default: return 0; }
    if (p + n > r->end) return 0;
    for (i = 0; i < n; i++) v = (v << 8) | p[i];
    if (v > 0x7fffffffffffffffULL) return 0;
    *out = (long long)v; r->p = p + n; return 1;
}
static int kv_rd_uint(kv_rd *r) {          /* skip one unsigned int (a checksum) */
    const unsigned char *p = r->p;
    if (p >= r->end) return 0;
    unsigned char c = *p++; int n;
    if (c < 0x80) { r->p = p; return 1; }
    switch (c) { case 0xcc: n = 1; break; case 0xcd: n = 2; break;
                 case 0xce: n = 4; break; case 0xcf: n = 8; break; default: return 0; }
    if (p + n > r->end) return 0;
    r->p = p + n; return 1;
}
static int kv_rd_key(kv_rd *r, const char *name, size_t n) {   /* fixstr == name */
    const unsigned char *p = r->p;
    if (p + 1 + n > r->end || *p != (0xa0 | n) || memcmp(p + 1, name, n)) return 0;
    r->p = p + 1 + n; return 1;
}
static int kv_rd_arr(kv_rd *r, int n) {    /* fixarray of n */
    if (r->p >= r->end || *r->p != (0x90 | n)) return 0;
    r->p++; return 1;
}
/* The usual reply to a one-key request of ``kind`` (0 PUT, 1 GET, 3 EXISTS) for
   ``rid``: 1 and *val (PUT: 0; GET: the size, -1 a miss; EXISTS: 0/1), or 0: anything
   else (another status, request id, field, form, or bytes after the header). */
static int kv_reply1(const unsigned char *buf, size_t len, int kind, kv_u64 rid,
                     long long *val) {
    kv_rd r = {buf, buf + len};
    long long v; int i, nf, seen = 0;
    if (len < 4 || buf[0] != 0x94 || buf[1] != 0x02 || buf[2] != 0x00) return 0;
    r.p = buf + 3;
    if (!kv_rd_int(&r, &v) || v < 0 || (kv_u64)v != rid) return 0;
    if (r.p >= r.end || (*r.p & 0xf0) != 0x80) return 0;
    nf = *r.p++ & 0x0f;
    if (kind == 0) {
        if (nf != 1 || !kv_rd_key(&r, "st", 2) || !kv_rd_arr(&r, 1) || r.p >= r.end
            || *r.p != 0x00) return 0;
        r.p++; *val = 0;
    } else if (kind == 3) {
        if (nf != 1 || !kv_rd_key(&r, "found", 5) || !kv_rd_arr(&r, 1) || r.p >= r.end
            || (*r.p != 0xc2 && *r.p != 0xc3)) return 0;
        *val = *r.p++ == 0xc3;
    } else {
        long long size = -3, count = -1;
        for (i = 0; i < nf; i++) {
            if (kv_rd_key(&r, "sizes", 5)) {
                if (seen & 1 || !kv_rd_arr(&r, 1) || !kv_rd_int(&r, &size)) return 0;
                seen |= 1;
            } else if (kv_rd_key(&r, "counts", 6)) {
                if (seen & 2) return 0;
                seen |= 2;
                if (kv_rd_arr(&r, 0)) count = 0;
                else if (!kv_rd_arr(&r, 1) || !kv_rd_int(&r, &count) || count != 1) return 0;
            } else if (kv_rd_key(&r, "sums", 4)) {
                if (seen & 4 || !kv_rd_arr(&r, 1) || !kv_rd_uint(&r)) return 0;
                seen |= 4;
            } else return 0;
        }
        if (size >= 0 && count == 1) *val = size;
        else if (size == -1 && count <= 0) *val = -1;
        else return 0;
    }
    return r.p == r.end;
}

#endif
