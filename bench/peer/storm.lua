-- wrk script: a retry storm. POST /orders with one body, each request's
-- Idempotency-Key drawn from a pool of KEYS keys (default 300; the
-- environment variable STORM_KEYS), shared by every thread: after the
-- pool's first pass, almost every request is a retry of a completed key.
-- The keys' prefix comes from the environment (STORM_PREFIX), so one run's
-- rounds retry the same keys and separate runs do not collide.
local body = '{"amount":100,"currency":"eur","items":[1,2,3]}'
local keys = tonumber(os.getenv("STORM_KEYS") or "300")
local prefix = os.getenv("STORM_PREFIX") or "storm"

function request()
  local headers = {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = prefix .. "-" .. math.random(keys),
  }
  return wrk.format("POST", nil, headers, body)
end
