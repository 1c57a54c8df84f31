package main

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
)

// The soak takes no 2xx on trust. A trainer reads any 200 as a sample, so
// every 2xx answer is decoded in full, with a decoder of its own rather
// than the router's structural check, and must carry what a client came
// for: an answer a worker broke that the router let through as a success
// is counted as such, not as answered.

// brokenError is a 2xx answer read to its end that is not whole: its JSON
// or msgpack does not decode, or what it should carry is missing.
type brokenError struct {
	call string
	err  error
}

func (e *brokenError) Error() string {
	return fmt.Sprintf("%s2xx answer not whole: %v", e.call, e.err)
}

// whole wraps the error of check as a brokenError of the call named.
func whole(call string, err error) error {
	if err == nil {
		return nil
	}
	return &brokenError{call, err}
}

// checkImages checks an answer of /v1/images/generations asked for
// b64_json: a JSON object whose data holds at least one image.
func checkImages(body []byte) error {
	var a struct {
		Data []struct {
			B64JSON string `json:"b64_json"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &a); err != nil {
		return err
	}
	if len(a.Data) == 0 {
		return errors.New("no image in data")
	}
	for _, d := range a.Data {
		if err := checkMedium(d.B64JSON); err != nil {
			return fmt.Errorf("b64_json: %w", err)
		}
	}
	return nil
}

// checkRollout checks an answer of /rollout/generate: a list of samples,
// msgpack or JSON as its Content-Type says, each with its
// generated_output tensor.
func checkRollout(body []byte, contentType string) error {
	var v any
	var err error
	if answer.FormatOf(contentType) == answer.Msgpack {
		v, err = msgpack.Unmarshal(body)
	} else {
		err = json.Unmarshal(body, &v)
	}
	if err != nil {
		return err
	}
	samples, _ := v.([]any)
	if len(samples) == 0 {
		return errors.New("no sample")
	}
	for _, s := range samples {
		sample, _ := s.(map[string]any)
		output, _ := sample["generated_output"].(map[string]any)
		data, _ := output["data"].(string)
		if err := checkMedium(data); err != nil {
			return fmt.Errorf("generated_output: %w", err)
		}
	}
	return nil
}

// checkMedium checks a medium sent as base64: it decodes, to something.
func checkMedium(b64 string) error {
	b, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return err
	}
	if len(b) == 0 {
		return errors.New("empty")
	}
	return nil
}
