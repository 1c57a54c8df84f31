-- wrk script: every request is the lightest generation job, a 1x1 image
-- with one step, whose service time on the fake worker is ~0: what is left
-- is the cost of proxying it.
wrk.method = "POST"
wrk.path = "/v1/images/generations"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"prompt":"x","size":"1x1","num_inference_steps":1,"response_format":"b64_json"}'
