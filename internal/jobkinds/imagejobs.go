package jobkinds

import (
	"bytes"
	"encoding/json"
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
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

// imageLearning is what an answer tells of the worker's image jobs.
type imageLearning uint8

const (
	learnNothing  imageLearning = iota
	learnMade                   // the answer names the image job it made
	learnStreamed               // the stream's first event names it
	learnDeleted                // the answer says whether the job it deleted is gone
)

// imageLearningOf is what the answer to r, with ticket t, tells.
func imageLearningOf(r *http.Request, t *scheduler.Ticket) imageLearning {
	switch {
	case r.Method == http.MethodPost && t.Route.Kind == request.ImageStream:
		return learnStreamed
	case r.Method == http.MethodPost && t.Route.LearnsImageID:
		return learnMade
	case r.Method == http.MethodDelete && t.Pin != "" && t.Route.Kind == request.ImagePoll:
		return learnDeleted
	}
	return learnNothing
}

// Learn reads, from the start of a 2xx answer to t's attempt r and before
// it goes out, the image job it made (then remembered as t's worker's),
// or whether the image job it deleted is gone (then forgotten), and
// reports whether it had what it needed. A client can thus use an id as
// soon as it reads it, even while the rest of the answer, or of the
// stream, is on its way.
func (k Kinds) Learn(r *http.Request, t *scheduler.Ticket, answer []byte) bool {
	switch imageLearningOf(r, t) {
	case learnStreamed:
		return k.rememberImage(firstEventData(answer), t)
	case learnMade:
		return k.rememberImage(answer, t)
	case learnDeleted:
		status, ok := leadingString(answer, "status")
		if status == "deleted" { // not "cancelling": a stream still running is still there
			k.pool.Images().Forget(t.Route.JobID)
		}
		return ok
	}
	return true // nothing to learn

}

// rememberImage remembers the image job that answer, a JSON object, names
// as t's worker's, and reports whether answer named one.
func (k Kinds) rememberImage(answer []byte, t *scheduler.Ticket) bool {
	id, ok := leadingString(answer, "id")
	if ok && request.ValidJobID(id) {
		k.pool.Images().Remember(id, t.ServedBy(), t.Tenant)
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
