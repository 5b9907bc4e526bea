-- Argo CD health check for kvferry.io/DisaggregatedInference (Lua 5.1, as Argo CD runs it).
-- Reads only what the operator publishes: status.observedGeneration and the conditions
-- Ready, Progressing, Degraded and TransferHealthy (each with its own observedGeneration).
local hs = { status = "Progressing", message = "Waiting for the kvferry operator to report status" }
if obj.status == nil then
  return hs
end

local generation = obj.metadata.generation or 0
local observed = obj.status.observedGeneration
if observed == nil or observed < generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = {}
if obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    -- A condition written for an older generation says nothing about the current spec.
    if condition.observedGeneration == nil or condition.observedGeneration >= generation then
      conditions[condition.type] = condition
    end
  end
end

local function describe(condition)
  local text = condition.type .. "=" .. condition.status
  if condition.reason ~= nil and condition.reason ~= "" then
    text = text .. " (" .. condition.reason .. ")"
  end
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

local degraded = conditions["Degraded"]
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end

-- Pods may all be Ready while no KV moves (e.g. NIXL fell back to TCP or a peer is stale): that is
-- not a healthy P/D service.
local transfer = conditions["TransferHealthy"]
if transfer ~= nil and transfer.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(transfer)
  return hs
end

local ready = conditions["Ready"]
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

local progressing = conditions["Progressing"]
if progressing ~= nil and progressing.status == "True" then
  hs.message = describe(progressing)
elseif ready ~= nil then
  hs.message = describe(ready)
end
return hs
