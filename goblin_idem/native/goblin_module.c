/*
 * goblin: GOBLIN.CLAIM, GOBLIN.CAEXPIRE, GOBLIN.CAS and GOBLIN.CAD as a loadable
 * module for Redis 7.0+ and Valkey 8+/9.
 *
 * Every command runs entirely inside one call of its handler on the server's main
 * thread, so each one is atomic the same way a built-in command or a Lua script is:
 * no other client's command can run between its read and its write.
 *
 * Replication and the AOF get the *effect* of a command as plain built-in commands
 * with absolute times (SET ... PXAT, PEXPIREAT, SET ... KEEPTTL, DEL), never the
 * GOBLIN command itself. A replica or an AOF reload therefore needs no module and
 * reproduces the same absolute expiry, however late it applies the stream.
 *
 * No silent divergence: a command asks the server to replicate its effect *before* it
 * changes the key (the server sends what was asked only once the command returns, so
 * the order inside the handler is free). The server refuses when the built-in command
 * is missing (`rename-command PEXPIREAT ""`, or renamed to another name); the GOBLIN
 * command then changes nothing, replies an error naming the missing command, and the
 * module logs one warning per missing command. Once the server accepted, the changes
 * that follow cannot fail for a key opened for writing with a non-negative deadline;
 * should one fail anyway, the key is deleted on the primary and the replicas alike.
 * (On Valkey 8.1+ a CAEXPIRE into the past is an expiry, which the server propagates
 * itself; see expire_now.)
 *
 * A compare never changes how the server stores the value: reading an int-encoded or
 * embedded string through DMA would rewrite it as a separate allocation (see
 * read_value). A failed compare therefore allocates nothing that outlives the command,
 * which is why CAD and CAEXPIRE may run under maxmemory, like DEL and PEXPIRE.
 *
 * The module refuses to be unloaded (RedisModule_OnUnload): a transaction queued before
 * MODULE UNLOAD would call a freed command at EXEC and crash the server (Redis 7.0 and
 * Valkey 9). A new build is loaded by restarting the server with it.
 *
 * A short value is read through an internal GET (see read_value), so such reads show in
 * INFO commandstats as cmdstat_get, as the scripts' redis.call("get") do.
 *
 * The server's module ABI is declared below by hand: only the handful of entry
 * points, constants and structs this file uses. Names and values follow the public
 * module API reference ("RedisModule_*" names are accepted by Valkey too).
 */

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------- */
/* Module ABI: opaque handles, constants, entry points.                       */
/* ------------------------------------------------------------------------- */

typedef struct ModCtx ModCtx;    /* RedisModuleCtx */
typedef struct ModKey ModKey;    /* RedisModuleKey */
typedef struct ModStr ModStr;    /* RedisModuleString */
typedef struct ModCmd ModCmd;    /* RedisModuleCommand */
typedef struct ModReply ModReply; /* RedisModuleCallReply */
typedef long long mod_mstime;    /* mstime_t */
typedef struct { uint64_t id, dataver; } mod_event; /* RedisModuleEvent */
typedef void (*mod_event_fn)(ModCtx *ctx, mod_event event, uint64_t subevent, void *data);
typedef int (*mod_cmd_fn)(ModCtx *ctx, ModStr **argv, int argc);

#define MOD_OK 0
#define MOD_ERR 1
#define MOD_APIVER_1 1
#define MOD_READ (1 << 0)
#define MOD_WRITE (1 << 1)
#define MOD_KEYTYPE_EMPTY 0
#define MOD_KEYTYPE_STRING 1
#define MOD_NO_EXPIRE (-1LL)
#define MOD_REPLY_STRING 0
#define MOD_EVENT_SHUTDOWN 5
#define MOD_NOTIFY_GENERIC (1 << 2)
#define MOD_NOTIFY_STRING (1 << 3)
#define MOD_NOTIFY_EXPIRED (1 << 8)
/* We signal WATCH / client-tracking invalidation ourselves, only for keys we really
 * changed: a lost claim or a failed compare must not abort another client's MULTI. */
#define MOD_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED (1 << 1)

/* Command info (key specs), API version 1 layout. */
#define MOD_CMD_KEY_RO (1ULL << 0)
#define MOD_CMD_KEY_RW (1ULL << 1)
#define MOD_CMD_KEY_OW (1ULL << 2)
#define MOD_CMD_KEY_ACCESS (1ULL << 4)
#define MOD_CMD_KEY_UPDATE (1ULL << 5)
#define MOD_CMD_KEY_INSERT (1ULL << 6)
#define MOD_CMD_KEY_DELETE (1ULL << 7)
#define MOD_KSPEC_BS_INDEX 2
#define MOD_KSPEC_FK_RANGE 2

typedef struct {
    const char *notes;
    uint64_t flags;
    int begin_search_type;
    union {
        struct { int pos; } index;
        struct { const char *keyword; int startfrom; } keyword;
    } bs;
    int find_keys_type;
    union {
        struct { int lastkey; int keystep; int limit; } range;
        struct { int keynumidx; int firstkey; int keystep; } keynum;
    } fk;
} mod_key_spec;

typedef struct {
    const char *since;
    const char *changes;
} mod_history_entry;

typedef struct {
    int version;
    size_t sizeof_historyentry;
    size_t sizeof_keyspec;
    size_t sizeof_arg;
} mod_cmd_info_version;

typedef struct {
    const mod_cmd_info_version *version;
    const char *summary;
    const char *complexity;
    const char *since;
    mod_history_entry *history;
    const char *tips;
    int arity;
    mod_key_spec *key_specs;
    void *args; /* no argument docs are declared, so the layout is never read */
} mod_cmd_info;

static const mod_cmd_info_version CMD_INFO_V1 = {
    .version = 1,
    .sizeof_historyentry = sizeof(mod_history_entry),
    .sizeof_keyspec = sizeof(mod_key_spec),
    .sizeof_arg = 0,
};

static int (*RM_GetApi)(const char *name, void *fnptr);
static void (*RM_SetModuleAttribs)(ModCtx *ctx, const char *name, int ver, int apiver);
static int (*RM_IsModuleNameBusy)(const char *name);
static void (*RM_SetModuleOptions)(ModCtx *ctx, int options);
static int (*RM_CreateCommand)(ModCtx *ctx, const char *name, mod_cmd_fn fn,
                               const char *flags, int firstkey, int lastkey, int keystep);
static ModCmd *(*RM_GetCommand)(ModCtx *ctx, const char *name);
static int (*RM_SetCommandInfo)(ModCmd *cmd, const mod_cmd_info *info);
static void *(*RM_OpenKey)(ModCtx *ctx, ModStr *name, int mode);
static void (*RM_CloseKey)(ModKey *key);
static int (*RM_KeyType)(ModKey *key);
static char *(*RM_StringDMA)(ModKey *key, size_t *len, int mode);
static int (*RM_StringSet)(ModKey *key, ModStr *value);
static const char *(*RM_StringPtrLen)(const ModStr *str, size_t *len);
static int (*RM_StringToLongLong)(const ModStr *str, long long *out);
static void (*RM_TrimStringAllocation)(ModStr *str);
static int (*RM_DeleteKey)(ModKey *key);
static mod_mstime (*RM_GetAbsExpire)(ModKey *key);
static int (*RM_SetAbsExpire)(ModKey *key, mod_mstime at);
static long long (*RM_Milliseconds)(void);
static int (*RM_Replicate)(ModCtx *ctx, const char *cmd, const char *fmt, ...);
static ModReply *(*RM_Call)(ModCtx *ctx, const char *cmd, const char *fmt, ...);
static int (*RM_CallReplyType)(ModReply *reply);
static const char *(*RM_CallReplyStringPtr)(ModReply *reply, size_t *len);
static void (*RM_FreeCallReply)(ModReply *reply);
static size_t (*RM_ValueLength)(ModKey *key);
static void (*RM_Log)(ModCtx *ctx, const char *level, const char *fmt, ...);
static int (*RM_SubscribeToServerEvent)(ModCtx *ctx, mod_event event, mod_event_fn callback);
static int (*RM_SignalModifiedKey)(ModCtx *ctx, ModStr *name);
static int (*RM_NotifyKeyspaceEvent)(ModCtx *ctx, int type, const char *event, ModStr *key);
static int (*RM_ReplyWithError)(ModCtx *ctx, const char *err);
static int (*RM_ReplyWithLongLong)(ModCtx *ctx, long long ll);
static int (*RM_ReplyWithNull)(ModCtx *ctx);
static int (*RM_ReplyWithSimpleString)(ModCtx *ctx, const char *msg);
static int (*RM_ReplyWithStringBuffer)(ModCtx *ctx, const char *buf, size_t len);
static int (*RM_GetServerVersion)(void);

/* What PEXPIRE with a deadline already in the past does: on Redis, a plain deletion
 * ("del" event); on Valkey since 8.1, an expiry ("expired" event, counted in INFO's
 * expired_keys). Set at load time from the host server. */
static int past_deadline_is_expiry;

typedef struct {
    const char *name;
    void *slot;
    int required;
} api_entry;

#define API(fn, req) { "RedisModule_" #fn, (void *)&RM_##fn, req }

static const api_entry API_TABLE[] = {
    API(SetModuleAttribs, 1),
    API(IsModuleNameBusy, 1),
    API(SetModuleOptions, 1),
    API(CreateCommand, 1),
    API(OpenKey, 1),
    API(CloseKey, 1),
    API(KeyType, 1),
    API(StringDMA, 1),
    API(StringSet, 1),
    API(StringPtrLen, 1),
    API(StringToLongLong, 1),
    API(DeleteKey, 1),
    API(GetAbsExpire, 1),
    API(SetAbsExpire, 1),
    API(Milliseconds, 1),
    API(Replicate, 1),
    API(Call, 1),
    API(CallReplyType, 1),
    API(CallReplyStringPtr, 1),
    API(FreeCallReply, 1),
    API(ValueLength, 1),
    API(Log, 1),
    API(SubscribeToServerEvent, 1),
    API(SignalModifiedKey, 1),
    API(NotifyKeyspaceEvent, 1),
    API(ReplyWithError, 1),
    API(ReplyWithLongLong, 1),
    API(ReplyWithNull, 1),
    API(ReplyWithSimpleString, 1),
    API(ReplyWithStringBuffer, 1),
    /* Optional: key specs / arity metadata and argv trimming (Redis 7.0+). */
    API(GetCommand, 0),
    API(SetCommandInfo, 0),
    API(TrimStringAllocation, 0),
    API(GetServerVersion, 0),
};

/* ------------------------------------------------------------------------- */
/* Shared helpers.                                                            */
/* ------------------------------------------------------------------------- */

/* Error texts are written exactly as the server writes them for SET / PEXPIRE, with
 * the lowercase command name, so clients and tests see one vocabulary. */
#define ERR_ARITY(cmd) "ERR wrong number of arguments for '" cmd "' command"
#define ERR_EXPIRE(cmd) "ERR invalid expire time in '" cmd "' command"
#define ERR_NOT_INT "ERR value is not an integer or out of range"
#define ERR_WRONGTYPE "WRONGTYPE Operation against a key holding the wrong kind of value"
#define ERR_INTERNAL(cmd) "ERR " cmd " could not update the key"
/* RM_Replicate fails only when the server has no command of that name. */
#define ERR_NO_REPLICATION(cmd, repl)                                                 \
    "ERR " cmd " changed nothing: the server has no " repl " command to replicate it " \
    "with (remove 'rename-command " repl "' from the server configuration)"

/* After a real change: invalidate WATCH / client-side caches and tell keyspace
 * subscribers, exactly as the built-in command doing the same change would. */
static void touched(ModCtx *ctx, ModStr *key, int type, const char *event) {
    RM_SignalModifiedKey(ctx, key);
    RM_NotifyKeyspaceEvent(ctx, type, event, key);
}

/* The built-in commands effects are replicated as; a missing one is logged once. */
typedef enum { REPL_SET, REPL_PEXPIREAT, REPL_DEL, REPL_KINDS } repl_kind;
static const char *const REPL_NAME[REPL_KINDS] = { "SET", "PEXPIREAT", "DEL" };
static int repl_warned[REPL_KINDS];

/* The server refused to replicate an effect as `kind`: log that once, at warning level,
 * and reply `err`. */
static int replication_refused(ModCtx *ctx, repl_kind kind, const char *err) {
    if (!repl_warned[kind]) {
        repl_warned[kind] = 1;
        RM_Log(ctx, "warning",
               "the server has no %s command (rename-command?), so GOBLIN commands cannot "
               "replicate an effect with it: they reply an error instead of changing the key; "
               "remove 'rename-command %s' from the server configuration",
               REPL_NAME[kind], REPL_NAME[kind]);
    }
    return RM_ReplyWithError(ctx, err);
}

/* A change failed after its replication was queued. Never seen: RM_StringSet and
 * RM_SetAbsExpire only fail for a key not opened for writing or a negative deadline.
 * The key is deleted here and on the replicas, so they cannot disagree. */
static int drop_after_failure(ModCtx *ctx, ModKey *key, ModStr *name, const char *err) {
    int existed = RM_KeyType(key) != MOD_KEYTYPE_EMPTY;
    if (existed) RM_DeleteKey(key);
    RM_CloseKey(key);
    if (existed) touched(ctx, name, MOD_NOTIFY_GENERIC, "del");
    if (RM_Replicate(ctx, "DEL", "s", name) != MOD_OK)
        return replication_refused(ctx, REPL_DEL, err);
    return RM_ReplyWithError(ctx, err);
}

/* Values of this length or shorter may be stored as an integer or embedded in their
 * object (Redis 7.0 embeds up to 44 bytes, Valkey 9 up to about 110 with the key);
 * longer ones are plain strings on both. */
#define SHORT_VALUE_MAX 256

typedef struct {
    const char *ptr;
    size_t len;
    ModReply *reply; /* owns ptr when not NULL; freed by release_value */
} stored_value;

/* Read the value of an open string key without changing how the server stores it.
 * DMA reads a plain string in place, but first rewrites an int-encoded or embedded one
 * as a separate allocation that outlives the command (24 bytes more per int-valued key,
 * even when the compare then fails). A short value is therefore copied out by a GET run
 * through the server, into a reply that is freed before the command returns; a long one
 * is read in place, never copied. Should that GET be refused (GET renamed), DMA still
 * reads the right bytes. Returns 0 for a value that is not a string. */
static int read_value(ModCtx *ctx, ModKey *key, ModStr *name, stored_value *out) {
    out->reply = NULL;
    if (RM_ValueLength(key) <= SHORT_VALUE_MAX) {
        ModReply *reply = RM_Call(ctx, "GET", "s", name);
        if (reply != NULL && RM_CallReplyType(reply) == MOD_REPLY_STRING) {
            out->ptr = RM_CallReplyStringPtr(reply, &out->len);
            out->reply = reply;
            return 1;
        }
        if (reply != NULL) RM_FreeCallReply(reply);
    }
    out->ptr = RM_StringDMA(key, &out->len, MOD_READ);
    return out->ptr != NULL;
}

static void release_value(stored_value *value) {
    if (value->reply != NULL) RM_FreeCallReply(value->reply);
}

typedef enum { CMP_MISSING, CMP_WRONGTYPE, CMP_DIFFERENT, CMP_EQUAL } cmp_result;

/* Compare the string at an open key with `expected`, byte for byte. The key was
 * opened (and so lazily expired) by the caller; a NULL handle means "no such key".
 * The stored length is known without reading the value, so most mismatches stop there. */
static cmp_result compare_value(ModCtx *ctx, ModKey *key, ModStr *name, const ModStr *expected) {
    if (key == NULL) return CMP_MISSING;
    int type = RM_KeyType(key);
    if (type == MOD_KEYTYPE_EMPTY) return CMP_MISSING;
    if (type != MOD_KEYTYPE_STRING) return CMP_WRONGTYPE;
    size_t want_len = 0;
    const char *want = RM_StringPtrLen(expected, &want_len);
    if (RM_ValueLength(key) != want_len) return CMP_DIFFERENT;
    if (want_len == 0) return CMP_EQUAL;
    stored_value have;
    if (!read_value(ctx, key, name, &have)) return CMP_WRONGTYPE;
    cmp_result r = have.len == want_len && memcmp(have.ptr, want, want_len) == 0
                       ? CMP_EQUAL
                       : CMP_DIFFERENT;
    release_value(&have);
    return r;
}

/* Reply for the outcomes that are the same in every compare-and-X command. */
static int reply_no_match(ModCtx *ctx, cmp_result r) {
    if (r == CMP_WRONGTYPE) return RM_ReplyWithError(ctx, ERR_WRONGTYPE);
    return RM_ReplyWithLongLong(ctx, 0);
}

/* ------------------------------------------------------------------------- */
/* GOBLIN.CLAIM claim_key result_key token seconds                           */
/*                                                                           */
/* Atomic: SET claim_key token NX EX seconds, and when the claim was held, GET  */
/* result_key, as one step; nothing can run between the existence test, the   */
/* write and the read.                                                       */
/* ------------------------------------------------------------------------- */

static int cmd_claim(ModCtx *ctx, ModStr **argv, int argc) {
    if (argc != 5) return RM_ReplyWithError(ctx, ERR_ARITY("goblin.claim"));

    /* Validate the lease before touching any key, with SET EX's rules and texts. */
    long long seconds;
    if (RM_StringToLongLong(argv[4], &seconds) != MOD_OK)
        return RM_ReplyWithError(ctx, ERR_NOT_INT);
    if (seconds <= 0 || seconds > LLONG_MAX / 1000)
        return RM_ReplyWithError(ctx, ERR_EXPIRE("goblin.claim"));
    long long now = RM_Milliseconds();
    long long ms = seconds * 1000;
    if (ms > LLONG_MAX - now) return RM_ReplyWithError(ctx, ERR_EXPIRE("goblin.claim"));
    long long at = now + ms;

    /* NX tests existence only: a claim key of any type makes the claim fail. */
    ModKey *claim = RM_OpenKey(ctx, argv[1], MOD_READ | MOD_WRITE);
    if (claim != NULL && RM_KeyType(claim) == MOD_KEYTYPE_EMPTY) {
        if (RM_Replicate(ctx, "SET", "sscl", argv[1], argv[3], "PXAT", at) != MOD_OK) {
            RM_CloseKey(claim);
            return replication_refused(ctx, REPL_SET, ERR_NO_REPLICATION("goblin.claim", "SET"));
        }
        /* Never leave a lease-less claim behind: it would be held forever. */
        if (RM_StringSet(claim, argv[3]) != MOD_OK || RM_SetAbsExpire(claim, at) != MOD_OK)
            return drop_after_failure(ctx, claim, argv[1], ERR_INTERNAL("goblin.claim"));
        RM_CloseKey(claim);
        touched(ctx, argv[1], MOD_NOTIFY_STRING, "set");
        RM_NotifyKeyspaceEvent(ctx, MOD_NOTIFY_GENERIC, "expire", argv[1]);
        return RM_ReplyWithStringBuffer(ctx, "CLAIMED", 7);
    }
    if (claim != NULL) RM_CloseKey(claim);

    /* The claim was held: a plain GET of the result, so a non-string is WRONGTYPE. */
    ModKey *result = RM_OpenKey(ctx, argv[2], MOD_READ);
    stored_value value;
    int rc;
    if (result == NULL || RM_KeyType(result) == MOD_KEYTYPE_EMPTY) {
        rc = RM_ReplyWithNull(ctx);
    } else if (RM_KeyType(result) != MOD_KEYTYPE_STRING ||
               !read_value(ctx, result, argv[2], &value)) {
        rc = RM_ReplyWithError(ctx, ERR_WRONGTYPE);
    } else {
        rc = RM_ReplyWithStringBuffer(ctx, value.ptr, value.len);
        release_value(&value);
    }
    if (result != NULL) RM_CloseKey(result);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* GOBLIN.CAEXPIRE key expected ms                                           */
/*                                                                           */
/* Atomic: the compare and the TTL update are one step, so a lease is only     */
/* renewed while the caller's token is still the one stored.                 */
/* ------------------------------------------------------------------------- */

/* A deadline already in the past ends the key the way PEXPIRE does on this server. */
static int expire_now(ModCtx *ctx, ModKey *key, ModStr *name) {
    if (past_deadline_is_expiry && RM_SetAbsExpire(key, 0) == MOD_OK) {
        /* Valkey 8.1+: PEXPIRE expires the key, counted in expired_keys, which no module
         * call can do. The server's own lazy expiry can: the key now has a deadline in
         * the past, and looking it up again deletes it exactly as PEXPIRE does (the
         * "expired" event, WATCH invalidation, expired_keys, and a DEL or UNLINK
         * propagated as lazyfree-lazy-expire says, by the server itself). */
        RM_CloseKey(key);
        ModKey *again = RM_OpenKey(ctx, name, MOD_READ | MOD_WRITE);
        if (again != NULL) RM_CloseKey(again);
        return RM_ReplyWithLongLong(ctx, 1);
    }
    if (RM_Replicate(ctx, "DEL", "s", name) != MOD_OK) {
        RM_CloseKey(key);
        return replication_refused(ctx, REPL_DEL, ERR_NO_REPLICATION("goblin.caexpire", "DEL"));
    }
    RM_DeleteKey(key);
    RM_CloseKey(key);
    if (past_deadline_is_expiry)
        touched(ctx, name, MOD_NOTIFY_EXPIRED, "expired");
    else
        touched(ctx, name, MOD_NOTIFY_GENERIC, "del");
    return RM_ReplyWithLongLong(ctx, 1);
}

static int cmd_caexpire(ModCtx *ctx, ModStr **argv, int argc) {
    if (argc != 4) return RM_ReplyWithError(ctx, ERR_ARITY("goblin.caexpire"));

    /* Validated before the key is read, as PEXPIRE does. */
    long long ms;
    if (RM_StringToLongLong(argv[3], &ms) != MOD_OK) return RM_ReplyWithError(ctx, ERR_NOT_INT);
    long long now = RM_Milliseconds();
    if (ms > 0 && ms > LLONG_MAX - now)
        return RM_ReplyWithError(ctx, ERR_EXPIRE("goblin.caexpire"));

    ModKey *key = RM_OpenKey(ctx, argv[1], MOD_READ | MOD_WRITE);
    cmp_result r = compare_value(ctx, key, argv[1], argv[2]);
    if (r != CMP_EQUAL) {
        if (key != NULL) RM_CloseKey(key);
        return reply_no_match(ctx, r);
    }
    if (ms <= 0) return expire_now(ctx, key, argv[1]);

    long long at = now + ms;
    if (RM_Replicate(ctx, "PEXPIREAT", "sl", argv[1], at) != MOD_OK) {
        RM_CloseKey(key);
        return replication_refused(ctx, REPL_PEXPIREAT,
                                   ERR_NO_REPLICATION("goblin.caexpire", "PEXPIREAT"));
    }
    if (RM_SetAbsExpire(key, at) != MOD_OK)
        return drop_after_failure(ctx, key, argv[1], ERR_INTERNAL("goblin.caexpire"));
    RM_CloseKey(key);
    touched(ctx, argv[1], MOD_NOTIFY_GENERIC, "expire");
    return RM_ReplyWithLongLong(ctx, 1);
}

/* ------------------------------------------------------------------------- */
/* GOBLIN.CAS key expected new                                               */
/*                                                                           */
/* Atomic: compare and overwrite are one step (optimistic concurrency without  */
/* WATCH); the key's absolute expiry is carried over unchanged.              */
/* ------------------------------------------------------------------------- */

static int cmd_cas(ModCtx *ctx, ModStr **argv, int argc) {
    if (argc != 4) return RM_ReplyWithError(ctx, ERR_ARITY("goblin.cas"));

    ModKey *key = RM_OpenKey(ctx, argv[1], MOD_READ | MOD_WRITE);
    cmp_result r = compare_value(ctx, key, argv[1], argv[2]);
    if (r != CMP_EQUAL) {
        if (key != NULL) RM_CloseKey(key);
        return reply_no_match(ctx, r);
    }
    if (RM_Replicate(ctx, "SET", "ssc", argv[1], argv[3], "KEEPTTL") != MOD_OK) {
        RM_CloseKey(key);
        return replication_refused(ctx, REPL_SET, ERR_NO_REPLICATION("goblin.cas", "SET"));
    }

    /* StringSet replaces the key and drops its TTL: keep the absolute deadline. */
    mod_mstime at = RM_GetAbsExpire(key);
    /* The new value is kept by reference; give back a network buffer's slack first. */
    if (RM_TrimStringAllocation != NULL) RM_TrimStringAllocation(argv[3]);
    /* A leased value must not silently become permanent. */
    if (RM_StringSet(key, argv[3]) != MOD_OK ||
        (at != MOD_NO_EXPIRE && RM_SetAbsExpire(key, at) != MOD_OK))
        return drop_after_failure(ctx, key, argv[1], ERR_INTERNAL("goblin.cas"));
    RM_CloseKey(key);
    touched(ctx, argv[1], MOD_NOTIFY_STRING, "set");
    return RM_ReplyWithSimpleString(ctx, "OK");
}

/* ------------------------------------------------------------------------- */
/* GOBLIN.CAD key expected                                                   */
/*                                                                           */
/* Atomic: compare and delete are one step, so a holder can only release a    */
/* lock that still carries its own token.                                    */
/* ------------------------------------------------------------------------- */

static int cmd_cad(ModCtx *ctx, ModStr **argv, int argc) {
    if (argc != 3) return RM_ReplyWithError(ctx, ERR_ARITY("goblin.cad"));

    ModKey *key = RM_OpenKey(ctx, argv[1], MOD_READ | MOD_WRITE);
    cmp_result r = compare_value(ctx, key, argv[1], argv[2]);
    if (r != CMP_EQUAL) {
        if (key != NULL) RM_CloseKey(key);
        return reply_no_match(ctx, r);
    }
    if (RM_Replicate(ctx, "DEL", "s", argv[1]) != MOD_OK) {
        RM_CloseKey(key);
        return replication_refused(ctx, REPL_DEL, ERR_NO_REPLICATION("goblin.cad", "DEL"));
    }
    RM_DeleteKey(key);
    RM_CloseKey(key);
    touched(ctx, argv[1], MOD_NOTIFY_GENERIC, "del");
    return RM_ReplyWithLongLong(ctx, 1);
}

/* ------------------------------------------------------------------------- */
/* Registration.                                                             */
/* ------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    mod_cmd_fn fn;
    /* CAD and CAEXPIRE never grow memory and must work under maxmemory, like DEL and
     * PEXPIRE (and like the scripts they replace): a lock release refused with OOM
     * would keep the lock held until its lease runs out. Their compares allocate
     * nothing that outlives the command (read_value); a renewal may add an expiry
     * entry, as PEXPIRE does.
     * `fast` (O(1), never blocks) is kept for CLAIM, CAD and CAEXPIRE, whose byte
     * compares are bounded by a lease token sent with the command. CAS is not `fast`:
     * like SET, it stores a value of any size, and compares one (a 100 MB compare
     * holds the main thread for milliseconds). */
    const char *flags;
    int firstkey, lastkey;
    int arity;
    const char *summary;
    const char *complexity;
    mod_key_spec specs[3];
} command_def;

#define KEY_AT(argpos, fl)                                                             \
    { .flags = (fl), .begin_search_type = MOD_KSPEC_BS_INDEX, .bs.index.pos = (argpos), \
      .find_keys_type = MOD_KSPEC_FK_RANGE,                                          \
      .fk.range = { .lastkey = 0, .keystep = 1, .limit = 0 } }

static const command_def COMMANDS[] = {
    { "goblin.claim", cmd_claim, "write deny-oom fast", 1, 2, 5,
      "Take a leased claim if it is free, else read the stored result.", "O(1)",
      { KEY_AT(1, MOD_CMD_KEY_OW | MOD_CMD_KEY_INSERT),
        KEY_AT(2, MOD_CMD_KEY_RO | MOD_CMD_KEY_ACCESS), { 0 } } },
    { "goblin.caexpire", cmd_caexpire, "write fast", 1, 1, 4,
      "Set a key's TTL in milliseconds if it holds the expected string.", "O(1)",
      { KEY_AT(1, MOD_CMD_KEY_RW | MOD_CMD_KEY_ACCESS | MOD_CMD_KEY_UPDATE), { 0 } } },
    { "goblin.cas", cmd_cas, "write deny-oom", 1, 1, 4,
      "Overwrite a key, keeping its TTL, if it holds the expected string.",
      "O(N) where N is the length of the expected value",
      { KEY_AT(1, MOD_CMD_KEY_RW | MOD_CMD_KEY_ACCESS | MOD_CMD_KEY_UPDATE), { 0 } } },
    { "goblin.cad", cmd_cad, "write fast", 1, 1, 3,
      "Delete a key if it holds the expected string.", "O(1)",
      { KEY_AT(1, MOD_CMD_KEY_RW | MOD_CMD_KEY_ACCESS | MOD_CMD_KEY_DELETE), { 0 } } },
};

static int register_command(ModCtx *ctx, const command_def *def) {
    if (RM_CreateCommand(ctx, def->name, def->fn, def->flags, def->firstkey, def->lastkey, 1) !=
        MOD_OK)
        return MOD_ERR;
    if (RM_GetCommand == NULL || RM_SetCommandInfo == NULL) return MOD_OK;
    /* With the arity declared, the server itself rejects a wrong argument count with
     * its usual text; the handlers still check, for servers without this API. */
    ModCmd *cmd = RM_GetCommand(ctx, def->name);
    if (cmd == NULL) return MOD_ERR;
    mod_cmd_info info = {
        .version = &CMD_INFO_V1,
        .summary = def->summary,
        .complexity = def->complexity,
        .arity = def->arity,
        .key_specs = (mod_key_spec *)def->specs,
    };
    return RM_SetCommandInfo(cmd, &info);
}

static int shutting_down;

static void on_shutdown(ModCtx *ctx, mod_event event, uint64_t subevent, void *data) {
    (void)ctx, (void)event, (void)subevent, (void)data;
    shutting_down = 1;
}

int RedisModule_OnLoad(ModCtx *ctx, ModStr **argv, int argc) {
    (void)argv;
    (void)argc;
    /* The API lookup function is the first field of the load context. */
    memcpy(&RM_GetApi, ctx, sizeof RM_GetApi);
    for (size_t i = 0; i < sizeof API_TABLE / sizeof API_TABLE[0]; i++) {
        if (RM_GetApi(API_TABLE[i].name, API_TABLE[i].slot) != MOD_OK) {
            if (API_TABLE[i].required) return MOD_ERR;
            memset(API_TABLE[i].slot, 0, sizeof(void (*)(void)));
        }
    }
    void (*probe)(void) = NULL;
    past_deadline_is_expiry = RM_GetApi("ValkeyModule_OpenKey", &probe) == MOD_OK &&
                              RM_GetServerVersion != NULL && RM_GetServerVersion() >= 0x080100;
    /* A second load under the same name must fail cleanly, not re-register. */
    if (RM_IsModuleNameBusy("goblin")) return MOD_ERR;
    RM_SetModuleAttribs(ctx, "goblin", 1, MOD_APIVER_1);
    RM_SetModuleOptions(ctx, MOD_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED);
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (register_command(ctx, &COMMANDS[i]) != MOD_OK) return MOD_ERR;
    RM_SubscribeToServerEvent(ctx, (mod_event){ MOD_EVENT_SHUTDOWN, 1 }, on_shutdown);
    return MOD_OK;
}

/* Unloading is refused, and both Redis 7.0 and Valkey 9 cancel MODULE UNLOAD when this
 * returns an error. A transaction queued before the unload keeps a pointer to the
 * freed command, and its EXEC would crash the server. A new build is loaded by
 * restarting the server with it (one node at a time, replicas first, for no downtime).
 * Only a server that is shutting down (Valkey unloads every module on its way out)
 * is let go: no command runs after that. */
int RedisModule_OnUnload(ModCtx *ctx) {
    if (shutting_down) return MOD_OK;
    RM_Log(ctx, "warning",
           "goblin cannot be unloaded (a queued MULTI would call its freed commands); "
           "restart the server to load another build");
    return MOD_ERR;
}
