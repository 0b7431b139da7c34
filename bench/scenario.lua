-- wrk script for http_bench.py: POST /orders with the scenario's Idempotency-Key.
--   wrk ... -s bench/scenario.lua URL -- MODE PREFIX NKEYS
-- MODE new:      a new key on every request (PREFIX-<thread>-<n>)
--      replay:   cycles through the completed keys PREFIX-0 .. PREFIX-(NKEYS-1)
--      inflight: always the key PREFIX, whose claim the server holds
--      nokey:    no Idempotency-Key header
-- done() prints one line "BENCH {json}" with the counts and latency percentiles.

local threads = {}
local mode, prefix, nkeys = "nokey", "k", 1
local counter = 0
local headers = nil
local fixed = nil

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  mode = args[1] or "nokey"
  prefix = args[2] or "k"
  nkeys = tonumber(args[3] or "1")
  wrk.method = "POST"
  wrk.body = '{"sku":"A-1","qty":2}'
  wrk.headers["Content-Type"] = "application/json"
  headers = {}
  for name, value in pairs(wrk.headers) do
    headers[name] = value
  end
  if mode == "new" then
    prefix = prefix .. "-" .. tostring(tid or 1)
  elseif mode == "inflight" then
    headers["Idempotency-Key"] = prefix
    fixed = wrk.format(nil, nil, headers)
  elseif mode == "nokey" then
    fixed = wrk.format()
  end
end

function request()
  if fixed then
    return fixed
  end
  counter = counter + 1
  if mode == "new" then
    headers["Idempotency-Key"] = prefix .. "-" .. counter
  else
    headers["Idempotency-Key"] = prefix .. "-" .. (counter % nkeys)
  end
  return wrk.format(nil, nil, headers)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests": %d, "duration_us": %d, "status_errors": %d, "socket_errors": %d, '
      .. '"p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
