/*
 * The claim protocol of one idempotency key, as a model that SPIN explores exhaustively.
 *
 * docs/protocol.md maps each step below to the code that makes it, says what each
 * configuration checks, and how to run the checker (tests/test_model.py runs it in CI).
 *
 * N clients send the same keyed request. Each one retries until it is answered: after a
 * 409 (the key is in flight), after a 5xx (the work failed, the key was released) and after
 * its run crashed. A run is one attempt that won the claim, with a token of its own.
 *
 * Faults, each at most as often as its budget, at any point (so all interleavings):
 *   LOSSES   the store loses every key (a restart without persistence, eviction);
 *   LAPSES   a live run's claim expires (the run was paused past its lease: the watchdog's
 *            renewal never landed);
 *   CRASHES  a run's process dies at any step (its transaction rolls back with it; its
 *            claim stays until its lease expires);
 *   FAILS    the work fails, or its commit does (5xx, rolled back, claim released by CAD);
 *   PUBFAILS the publish never lands (store unreachable until the lease ran out).
 * A crashed run's lease expires eventually (weak fairness: the expiry is enabled until taken).
 *
 * With RECORDS (SQL records) the run's effects and its record commit in one transaction,
 * fenced by the key's unique row. Without it the work's effects happen when it runs.
 *
 * Checked, as assertions and one LTL property:
 *   (a) no two runs' effects commit for one key            effects <= 1, asserted
 *   (b) an answer once given to a client never changes     give(): every answer == the first
 *   (c) a run whose claim lapsed never publishes over
 *       another's answer                                   publish(): NX, asserted
 *   (d) every client is eventually answered once the
 *       faults stop (their budgets are finite)             ltl answered
 * Seeded bugs, each caught with a counterexample (docs/protocol.md): BUG_NO_FENCE (the record
 * inserted without the key's unique row: (a)), BUG_IGNORE_COMMITTED (a run whose commit the
 * row refused answers its own response: (b)), BUG_PUBLISH_OVERWRITES (publish without NX: a
 * lapsed run writes over the stored answer: (c)), BUG_LEAKED_LEASE (a failed run keeps its
 * lease renewed and its claim: (d)).
 */

#ifndef N
#define N 2
#endif
#ifndef LOSSES
#define LOSSES 1
#endif
#ifndef LAPSES
#define LAPSES 1
#endif
#ifndef CRASHES
#define CRASHES 1
#endif
#ifndef FAILS
#define FAILS 1
#endif
#ifndef PUBFAILS
#define PUBFAILS 0
#endif
#define MAXTOK 16

/* (a) and (b); NO_EFFECT_CHECKS leaves them out, for a store without records under the
 * faults that the guarantee without records does not cover (docs/guarantees.md). */
#ifdef NO_EFFECT_CHECKS
#define CHECK(c) skip
#else
#define CHECK(c) assert(c)
#endif

/* The store: the claim's token (0: free) and the stored result (0: none, else the token of
 * the run whose response it is). */
byte claim;
byte result;
/* The app's database: the key's record (0: none, else the token of the run that committed
 * it) and how many runs' effects committed. */
byte record;
byte effects;

/* Ghosts: the first answer any client got, how many clients were answered, the tokens
 * handed out, which runs renew no lease, and the faults spent. */
byte first;
byte answered;
byte tokens;
bool idle[MAXTOK];  /* the run no longer renews its lease (done, failed or dead) */
byte before;
byte losses, lapses, crashes, fails, pubfails;

/* A client is given `x` as the key's answer. (b) */
inline give(x) {
    assert(x != 0);
    if
    :: first == 0 -> first = x
    :: else -> CHECK(first == x)
    fi;
    answered++
}

/* GOBLIN.CLAIM where a stored result wins over a free claim (Store.claim_unless_done),
 * one atomic step: CLAIMED (reply = 255, `tok` the new run's token), the stored result, or
 * 0 (in flight). A result found under a free claim takes the claim for the result's TTL,
 * under a token no run renews. */
inline claim_step(tok, reply) {
    atomic {
        if
        :: claim == 0 && result == 0 ->
            tokens++; tok = tokens; claim = tok; reply = 255
        :: claim == 0 && result != 0 ->
            tokens++; claim = tokens; idle[tokens] = true; reply = result
        :: claim != 0 -> reply = result
        fi;
        assert(tokens < MAXTOK)
    }
}

/* SET result NX + CAEXPIRE claim token, one MULTI/EXEC (Store.publish). (c) */
inline publish(tok, data) {
    atomic {
        before = result;
#ifdef BUG_PUBLISH_OVERWRITES
        result = data;
#else
        if
        :: result == 0 -> result = data
        :: else -> skip  /* SUPERSEDED: the stored answer stands */
        fi;
#endif
        assert(before == 0 || result == before);
        /* a run whose claim lapsed takes it back if free (_retake); never another's */
        if
        :: claim == 0 -> claim = tok
        :: else -> skip
        fi
    }
}

/* Free the claim only if it still holds the run's token: GOBLIN.CAD (free_claim). */
inline release(tok) {
    atomic {
        if
        :: claim == tok -> claim = 0
        :: else -> skip
        fi
    }
}

/* A failed run stops renewing its lease and frees the claim (CAD), so a retry runs at once. */
#ifdef BUG_LEAKED_LEASE
#define LET_GO(tok) skip
#else
#define LET_GO(tok) idle[tok] = true; release(tok)
#endif

/* Faults a run may meet between its steps: the process dies (`goto crashed`). */
#define MAYBE_CRASH \
    if \
    :: atomic { crashes < CRASHES -> crashes++; idle[tok] = true }; goto crashed \
    :: skip \
    fi

proctype Client() {
    byte reply, tok, data;
    bool done = false;

retry:
    claim_step(tok, reply);
    if
    :: reply == 0 -> goto retry                      /* 409 in flight: retry later */
    :: reply != 0 && reply != 255 -> give(reply); goto finished   /* replay */
    :: reply == 255 -> skip                          /* CLAIMED: this run does the work */
    fi;
    MAYBE_CRASH;

#ifdef RECORDS
    /* the database's word on a won claim (Lookup): a committed record is published back
     * to the store and answered; nothing runs */
    if
    :: record != 0 ->
        data = record;
        publish(tok, data);
        idle[tok] = true;
        give(data);
        goto finished
    :: else -> skip
    fi;
    MAYBE_CRASH;
    /* the work runs in the run's transaction: its effects are not committed yet */
    if
    :: atomic { fails < FAILS -> fails++ } ->        /* the work (or its commit) failed */
        LET_GO(tok);
        goto retry
    :: skip
    fi;
    MAYBE_CRASH;
    /* commit the work's effects and the record together, fenced by the key's row
     * (RunTransaction.commit): refused if another run's record is there */
    atomic {
#ifdef BUG_NO_FENCE
        record = tok; effects++; data = tok; CHECK(effects <= 1)
#else
        if
        :: record == 0 -> record = tok; effects++; data = tok; CHECK(effects <= 1)
#ifdef BUG_IGNORE_COMMITTED
        :: else -> data = tok                        /* answers its own, not the record */
#else
        :: else -> data = record                     /* Committed: rolled back */
#endif
        fi
#endif
    };
    MAYBE_CRASH;
#else
    /* without records the work's effects happen as it runs */
    if
    :: atomic { fails < FAILS -> fails++ } ->
        LET_GO(tok);
        goto retry
    :: skip
    fi;
    effects++;
    CHECK(effects <= 1);
    data = tok;
    MAYBE_CRASH;
#endif

    /* publish (within the lease: publish_retried stops a third of a lease before it would
     * lapse), then the held response goes out; the watchdog no longer renews the lease */
    if
    :: atomic { pubfails < PUBFAILS -> pubfails++ } -> skip  /* never landed */
    :: publish(tok, data)
    fi;
    idle[tok] = true;
    give(data);
    goto finished;

crashed:
    goto retry;   /* the client's connection dropped: it sends the request again */

finished:
    done = true
}

/* A lease no run renews runs out; faults: a live run's lease lapses, the store loses its keys.
 * (end: a state where nothing here is enabled is a valid end) */
active proctype Store() {
end:
    do
    :: atomic { claim != 0 && idle[claim] -> claim = 0 }
    :: atomic { lapses < LAPSES && claim != 0 && !idle[claim] -> lapses++; claim = 0 }
    :: atomic { losses < LOSSES -> losses++; claim = 0; result = 0 }
    od
}

init {
    byte i;
    atomic {
        i = 0;
        do
        :: i < N -> run Client(); i++
        :: else -> break
        od
    }
}

/* (d): every client is answered (the fault budgets are finite, so faults stop). */
ltl answered_all { <> (answered == N) }
