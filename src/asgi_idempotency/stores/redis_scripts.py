"""The Redis store's Lua scripts, one per primitive, and the rows they return.

Part of :mod:`asgi_idempotency.stores.redis` (the store, whose docstring has the
fields of a record and what each script does).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import STATUS_OF, Record, RecordStatus, StoredResponse
from asgi_idempotency.stores.codec import decode_headers

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def _us(value: datetime) -> int:
    """Integer microseconds since the epoch (exact both ways)."""
    if value.tzinfo is None:
        raise StoreError("ValueError: naive datetime: pass an aware UTC datetime")
    return (value - _EPOCH) // _US


def _time(raw: bytes) -> datetime:
    return _EPOCH + timedelta(0, 0, int(raw))  # positional: half the cost of microseconds=…


_IN_PROGRESS = RecordStatus.IN_PROGRESS.value
_COMPLETED = RecordStatus.COMPLETED.value
_FIELDS = ("h", "s", "t", "c", "l", "e", "rs", "rh", "rb")

# A uuid token is unique to one request's claim, so meeting our own token means that
# an earlier attempt of this very call landed and only its answer was lost (redis-py
# retries a command after a dropped connection): report the write as ours rather
# than as somebody else's row. This is transport idempotency, not a lifecycle rule.
# So does a completion: only an in-progress row owned by the token completes, and a
# stored response is never overwritten; a row already completed under our own token
# with the very response we send is our first attempt's, and answers 1 (as the SQL
# stores answer a completion sent again whose first attempt landed), never a lost
# claim. A completed row with another response answers 0.

# The audit's index (suspected_duplicates), written by a claim that carries a scope
# digest, in the same script: ARGV[first] is the index's key (a sorted set in the
# record's own cluster slot: RedisStore._audit_key), ARGV[first + 1] the member
# "<scoped key> <scope digest> <request hash> <route>". Scored by the claim's
# expires_at plus its lease: members past it are trimmed here, and the set's TTL is at
# least the record's plus the lease. A completion restarts the record's retention from
# its own time (within the lease, unless renewed), so an index kept only as long as the
# claim's retention would end before the record it points to.
_AUDIT = """local a, m = ARGV[{first}], ARGV[{first} + 1]
  local ae = string.format('%d', tonumber(e) + tonumber(lease))
  local attl = math.ceil((tonumber(ttl_us) + tonumber(lease)) / 1000)
  redis.call('ZREMRANGEBYSCORE', a, '-inf', '(' .. c)
  redis.call('ZADD', a, ae, m)
  if redis.call('PTTL', a) < attl then redis.call('PEXPIRE', a, string.format('%d', attl)) end"""

# A claim travels as ONE argument, "lease_us ttl_us #h h token"
# (_claim_args): each argument is a round of redis-py's encoding and packing (several
# isinstance checks and a length header each), and Lua splits the string for next to
# nothing. The request hash and the token are any text: the length of h says where it
# ends, and the token is the rest.
# KEYS[1] record; ARGV the claim.
# Returns 0 when written, else the row in the way packed into ONE bulk string:
#   "s c l e rs #h #t #rh now\n" h t rh rb
# a line of the fields that are ours and never hold a space (rs empty while in
# progress), the byte lengths of h, t and rh and the server's time (TIME, in
# microseconds) when it read the row, then the four values back to back
# (binary-safe: the lengths say where each ends, the body is the rest). Every bulk
# reply is a few rounds of redis-py's pure-Python parser (a readline, a read, a
# decode), so one reply instead of an array of five is most of what a replay costs on
# our side of the socket, and _claimed takes it apart with one split and slices.
_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
"""


def _claim_script(arg: int) -> str:
    """The claim in ``ARGV[arg]`` taken apart, and its deadlines from the server's time:
    created, locked_until, expires_at (integers as text: Lua's own number formatting
    would round them) and the key's TTL in whole milliseconds, rounded up, at least 1
    (0 would delete it)."""
    return (
        _NOW
        + f"local lease, ttl_us, n, rest = string.match(ARGV[{arg}], '^(%d+) (%d+) (%d+) (.*)$')"
        + """
n = tonumber(n)
local h, t = string.sub(rest, 1, n), string.sub(rest, n + 1)
local c = string.format('%d', now)
local l = string.format('%d', now + tonumber(lease))
local e = string.format('%d', now + tonumber(ttl_us))
local ttl = math.ceil(tonumber(ttl_us) / 1000)
if ttl < 1 then ttl = 1 end
ttl = string.format('%d', ttl)
"""
    )


_INSERT = (
    _claim_script(1)
    + """
local row = redis.call('HMGET', KEYS[1], 'h', 's', 't', 'c', 'l', 'e', 'rs', 'rh', 'rb')
if row[1] then
  if row[3] == t then return 0 end
  local rh = row[8] or ''
  return row[2] .. ' ' .. row[4] .. ' ' .. row[5] .. ' ' .. row[6] .. ' ' .. (row[7] or '')
    .. ' ' .. #row[1] .. ' ' .. #row[3] .. ' ' .. #rh .. ' ' .. c .. '\\n'
    .. row[1] .. row[3] .. rh .. (row[9] or '')
end
redis.call('HSET', KEYS[1], 'h', h, 's', 'in_progress', 't', t, 'c', c, 'l', l, 'e', e)
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[2] then
"""
    + "  "
    + _AUDIT.format(first=2)
    + """
end
return 0
"""
)

# KEYS[1]; ARGV old token, old status, old locked_until, the claim (as _INSERT's).
# Compare-and-swap on the row as read: 1 if swapped.
_REPLACE = (
    _claim_script(4)
    + """
local row = redis.call('HMGET', KEYS[1], 't', 's', 'l')
if row[1] == t then return 1 end
if row[1] ~= ARGV[1] or row[2] ~= ARGV[2] or row[3] ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'h', h, 's', 'in_progress', 't', t, 'c', c, 'l', l, 'e', e)
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[5] then
"""
    + "  "
    + _AUDIT.format(first=5)
    + """
end
return 1
"""
)

# KEYS[1]; ARGV "status ttl_us token" (one argument, as a claim's; the token is the
# rest), headers, body. Retention runs from the server's time, as the key's TTL does.
_COMPLETE = (
    _NOW
    + """
local rs, ttl_us, t = string.match(ARGV[1], '^(%d+) (%d+) (.*)$')
local row = redis.call('HMGET', KEYS[1], 't', 's')
if row[1] ~= t then return 0 end
if row[2] == 'completed' then
  local done = redis.call('HMGET', KEYS[1], 'rs', 'rh', 'rb')
  if done[1] == rs and done[2] == ARGV[2] and done[3] == ARGV[3] then
    return 1
  end
  return 0
end
if row[2] ~= 'in_progress' then return 0 end
local e = string.format('%d', now + tonumber(ttl_us))
redis.call('HSET', KEYS[1], 's', 'completed', 'rs', rs, 'rh', ARGV[2], 'rb', ARGV[3], 'e', e)
local ttl = math.ceil(tonumber(ttl_us) / 1000)
if ttl < 1 then ttl = 1 end
redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl))
return 1
"""
)

# KEYS[1]; ARGV token.
_RELEASE = """
local row = redis.call('HMGET', KEYS[1], 't', 's')
if row[1] ~= ARGV[1] or row[2] ~= 'in_progress' then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1]; ARGV token, lease_us. The lease runs from the server's time. Retention
# never ends before the lease (Store.renew): past expires_at, the field moves to
# locked_until and the key's TTL to at least the lease, or Redis would delete a live
# claim.
_RENEW = (
    _NOW
    + """
local row = redis.call('HMGET', KEYS[1], 't', 's', 'e')
if row[1] ~= ARGV[1] or row[2] ~= 'in_progress' then return 0 end
local deadline = now + tonumber(ARGV[2])
local l = string.format('%d', deadline)
if deadline > tonumber(row[3]) then
  redis.call('HSET', KEYS[1], 'l', l, 'e', l)
  local ttl = math.ceil(tonumber(ARGV[2]) / 1000)
  if ttl > redis.call('PTTL', KEYS[1]) then
    redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl))
  end
else
  redis.call('HSET', KEYS[1], 'l', l)
end
return 1
"""
)

# KEYS[1]; ARGV the cut-off, or "" for the server's time. Deletes the row only if its
# expires_at has passed (a racing claim may have replaced it since it was scanned).
_PRUNE = (
    _NOW
    + """
local at = now
if ARGV[1] ~= '' then at = tonumber(ARGV[1]) end
local e = redis.call('HGET', KEYS[1], 'e')
if e and tonumber(e) <= at then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)


def _record(key: str, row: Sequence[Any]) -> Record:
    h, s, t, c, lu, e, rs, rh, rb = row
    response = None if rs is None else StoredResponse(int(rs), decode_headers(rh), bytes(rb))
    return Record(
        key, h.decode(), STATUS_OF[s.decode()], t.decode(), _time(c), _time(lu), _time(e), response
    )


# A row's status field to its member, from the bytes Redis returns (no decode).
_STATUS_OF_BYTES = {status.value.encode(): status for status in RecordStatus}


def _claimed(key: str, packed: bytes) -> Record:
    """The row in an insert's way, from ``_INSERT``'s one packed string."""
    line = packed.index(b"\n")
    s, c, lu, e, rs, nh, nt, nrh, read_at = packed[:line].split(b" ")
    h_end = line + 1 + int(nh)
    t_end = h_end + int(nt)
    response = None
    if rs:
        rh_end = t_end + int(nrh)
        headers = decode_headers(packed[t_end:rh_end])
        response = StoredResponse(int(rs), headers, packed[rh_end:])
    h, t = packed[line + 1 : h_end].decode(), packed[h_end:t_end].decode()
    return Record(
        key, h, _STATUS_OF_BYTES[s], t, _time(c), _time(lu), _time(e), response, _time(read_at)
    )
