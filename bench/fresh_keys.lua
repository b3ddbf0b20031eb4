-- The wrk script of bench/load.sh and bench/records.sh: POST /orders with
-- a fresh Idempotency-Key per request (start time and a random number,
-- the thread, the tag given after `--`, a counter), so every request is a
-- new key even across runs against one store. Prints
-- "RESULT answered rps p99ms errors".
local counter, prefix = 0, ""
local threads, started = {}, os.time() .. "-" .. math.random(1e9)
function setup(thread)
  table.insert(threads, thread)
  thread:set("id", #threads)
end
function init(args)
  prefix = started .. "-" .. id .. "-" .. (args[1] or "")
end
function request()
  counter = counter + 1
  return wrk.format("POST", "/orders", {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    -- The tenant of axum-orders (the gateway derives its own from
    -- Authorization).
    ["X-Tenant-Id"] = "bench",
    ["Idempotency-Key"] = prefix .. "-" .. counter,
  }, '{"sku":"book-42","qty":1,"note":"bench"}')
end
function done(summary, latency, requests)
  local errors = summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout
  io.write(string.format("RESULT %d %.0f %.3f %d\n", summary.requests - errors,
    summary.requests / (summary.duration / 1e6), latency:percentile(99) / 1000, errors))
end
