-- wrk script for the idempotency benchmark: wrk ... -s guard.lua -- <mode> <nonce>
-- mode: fresh (a new key per request), replay (one key, created before the run),
-- mix (of every 10: 5 fresh, 3 replays, 1 duplicate of a key sent 4 requests earlier,
-- mostly still in flight -> 409, 1 mismatch: a known key with another body -> 422).
-- Prints one line "BENCH_JSON {...}" with throughput, latency percentiles and statuses.

local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
  table.insert(threads, thread)
end

function init(args)
  mode = args[1] or "fresh"
  nonce = args[2] or tostring(os.time())
  counter = 0
  statuses = {}
  last = nil
  path = "/orders/o-42/refunds"
  body = '{"amount": 4500, "currency": "EUR"}'
  other = '{"amount": 4501, "currency": "EUR"}'
  headers = { ["Content-Type"] = "application/json" }
end

local function post(key, b)
  headers["Idempotency-Key"] = key
  return wrk.format("POST", path, headers, b)
end

function request()
  counter = counter + 1
  if mode == "fresh" then
    return post(nonce .. "-" .. tid .. "-" .. counter, body)
  elseif mode == "replay" then
    return post(nonce .. "-replay", body)
  end
  local slot = counter % 10
  if slot < 5 or last == nil then
    last = nonce .. "-" .. tid .. "-" .. counter
    return post(last, body)
  elseif slot < 8 then
    return post(nonce .. "-replay", body)
  elseif slot == 8 then
    return post(last, body)
  else
    return post(nonce .. "-replay", other)
  end
end

function response(status, hdrs, b)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local agg = {}
  for _, t in ipairs(threads) do
    local s = t:get("statuses")
    if s then
      for k, v in pairs(s) do agg[tostring(k)] = (agg[tostring(k)] or 0) + v end
    end
  end
  local parts = {}
  for k, v in pairs(agg) do table.insert(parts, string.format('"%s": %d', k, v)) end
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "socket_errors": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    table.concat(parts, ", ")))
end
