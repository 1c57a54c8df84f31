package diffusionrouter

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// sglang-diffusion keeps the images it made: GET /v1/images/{id}/content
// serves them and DELETE /v1/images/{id} forgets them, or cancels a
// streamed job still running. The id is in the answer that made the image,
// and only that worker knows it, so the router reads it from the answer as
// it goes out and pins the job's later requests to that worker.

// maxImageAnswerPeek bounds how much of an image answer the router reads
// for its id. sglang writes the id first: an ImageResponse begins with it,
// and a stream's first event (accepted) names it after its type and time.
// The rest, megabytes of base64, streams through unread.
const maxImageAnswerPeek = 1 << 10

// maxJobIDLength bounds the ids the router looks up; sglang's are uuids.
const maxJobIDLength = 128

var (
	errImageJobPath = errors.New("image job paths are /v1/images/{image_id} and /v1/images/{image_id}/content")
	errImageJobID   = fmt.Errorf("image_id must be 1 to %d letters, digits, '-', '_' or '.' (an escaped '/' is none of them)", maxJobIDLength)
)

// isImageJobPath reports whether path names an image job rather than an
// image generation endpoint.
func isImageJobPath(path string) bool {
	return strings.HasPrefix(path, "/v1/images/") && !generationPaths[path]
}

// imageJobID returns the id of an image job path, given as sent (escaped):
// /v1/images/{id} or /v1/images/{id}/content, with an id of the shape
// validJobID allows. The path is split at the slashes the client sent, so
// an id with an escaped one (%2F) is an id with a '/', and refused.
func imageJobID(escapedPath string) (string, error) {
	segment, tail, hasTail := strings.Cut(strings.TrimPrefix(escapedPath, "/v1/images/"), "/")
	if hasTail && tail != "content" {
		return "", errImageJobPath
	}
	id, err := url.PathUnescape(segment)
	if err != nil || !validJobID(id) {
		return "", errImageJobID
	}
	return id, nil
}

func validJobID(id string) bool {
	if id == "" || len(id) > maxJobIDLength {
		return false
	}
	for _, c := range []byte(id) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// pinImageJob pins t to the worker that made the image job r names. A
// non-zero status refuses r with that status and message.
func (h *Handler) pinImageJob(t *ticket, r *http.Request) (*ticket, int, string) {
	id, err := imageJobID(r.URL.EscapedPath())
	if err != nil {
		return nil, http.StatusBadRequest, err.Error()
	}
	worker, ok := h.pool.images.worker(id)
	if !ok {
		return nil, http.StatusNotFound, "Unknown image_id"
	}
	t.pin = worker
	return t, 0, ""
}

// learnImageJobs has rec read, from the start of r's answer and before it
// goes out, the image job it made (then remembered as t's worker's), or
// whether the image job it deleted is gone (then forgotten). A client can
// thus use an id as soon as it reads it, even while the rest of the answer,
// or of the stream, is on its way.
func (h *Handler) learnImageJobs(rec *recorder, r *http.Request, t *ticket) {
	var learn func(answer []byte) bool
	switch {
	case r.Method == http.MethodPost && streams(r):
		learn = func(answer []byte) bool { return h.rememberImage(firstEventData(answer), t) }
	case r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/images/") && generationPaths[r.URL.Path]:
		learn = func(answer []byte) bool { return h.rememberImage(answer, t) }
	case r.Method == http.MethodDelete && t.pin != "" && isImageJobPath(r.URL.Path):
		id, _ := imageJobID(r.URL.EscapedPath())
		learn = func(answer []byte) bool {
			status, ok := leadingString(answer, "status")
			if status == "deleted" { // not "cancelling": a stream still running is still there
				h.pool.images.forget(id)
			}
			return ok
		}
	default:
		return
	}
	rec.peekLimit = maxImageAnswerPeek
	rec.onPeek = func(peek []byte) bool {
		return rec.status < 200 || rec.status > 299 || learn(peek)
	}
}

// rememberImage remembers the image job that answer, a JSON object, names
// as t's worker's, and reports whether answer named one.
func (h *Handler) rememberImage(answer []byte, t *ticket) bool {
	id, ok := leadingString(answer, "id")
	if ok && validJobID(id) {
		h.pool.images.remember(id, t.servedBy)
	}
	return ok
}

// firstEventData is the data of the first server-sent event in stream, as
// far as stream goes.
func firstEventData(stream []byte) []byte {
	for line := range bytes.Lines(stream) {
		if data, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			return bytes.TrimPrefix(data, []byte(" "))
		}
	}
	return nil
}

// leadingString returns the string member name of the JSON object that b
// begins with, reading b only as far as that member; b may be cut short
// anywhere after it. ok is false when b ends first, or holds no such
// string member.
func leadingString(b []byte, name string) (value string, ok bool) {
	if v, ok := plainFirstMember(b, name); ok {
		return v, true
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return "", false
	}
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return "", false
		}
		if key == name {
			v, err := dec.Token()
			s, isString := v.(string)
			return s, err == nil && isString
		}
		if skipValue(dec) != nil {
			return "", false
		}
	}
	return "", false
}

// plainFirstMember is leadingString's fast path for the answer as
// sglang-diffusion writes it: the object's first member is name, a string
// of printable ASCII without escapes (a uuid), and no space around the
// colon. Anything else is left to the decoder.
func plainFirstMember(b []byte, name string) (string, bool) {
	rest, ok := bytes.CutPrefix(bytes.TrimLeft(b, " \t\r\n"), []byte(`{"`))
	if ok {
		rest, ok = bytes.CutPrefix(rest, []byte(name))
	}
	if ok {
		rest, ok = bytes.CutPrefix(rest, []byte(`":"`))
	}
	if !ok {
		return "", false
	}
	for i, c := range rest {
		switch {
		case c == '"':
			return string(rest[:i]), true
		case c < 0x20 || c > 0x7e || c == '\\':
			return "", false
		}
	}
	return "", false
}

// skipValue reads past the next value of dec.
func skipValue(dec *json.Decoder) error {
	depth := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
		case json.Delim('}'), json.Delim(']'):
			depth--
		}
		if depth == 0 {
			return nil
		}
	}
}
