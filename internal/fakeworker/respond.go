package fakeworker

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
)

// httpError is an error answered the way FastAPI answers an HTTPException:
// status and {"detail": detail}.
type httpError struct {
	status int
	detail any // a message, or the []fieldError of a validation failure
}

func (e *httpError) Error() string { return fmt.Sprint(e.detail) }

// schedulerError is an error sglang's scheduler reports for a job in its
// OutputBatch.error rather than raising it over HTTP; each endpoint turns it
// into its own answer (see failGeneration).
type schedulerError string

func (e schedulerError) Error() string { return string(e) }

// Errors of jobs that do not complete.
var (
	// errAsleep is the scheduler's answer to a generation while the memory
	// occupation is released (Scheduler._handle_generation).
	errAsleep   = schedulerError("Server is sleeping. Call resume_memory_occupation first.")
	errInjected = schedulerError("injected failure (--fail-rate)")
	errClosed   = &httpError{http.StatusServiceUnavailable, "worker is shutting down"}
	errCrashed  = &httpError{http.StatusServiceUnavailable, "worker crashed"}
	// errCancelled ends a streamed job that its client or a DELETE cancelled.
	errCancelled = errors.New("cancelled")
)

// noOutput is how the OpenAI-style endpoints word a scheduler error
// (process_generation_batch raises it as a RuntimeError).
func noOutput(err error) string {
	return "Model generation returned no output. Error from scheduler: " + err.Error()
}

func badRequest(format string, args ...any) error {
	return &httpError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

// fieldError is one entry of the list FastAPI answers, with status 422, when
// a request does not fit the endpoint's schema.
type fieldError struct {
	Type string `json:"type"`
	Loc  []any  `json:"loc"`
	Msg  string `json:"msg"`
}

// String reads like "body.n: Input should be a valid integer".
func (e fieldError) String() string {
	loc := make([]string, len(e.Loc))
	for i, l := range e.Loc {
		loc[i] = fmt.Sprint(l)
	}
	return strings.Join(loc, ".") + ": " + e.Msg
}

func invalid(errs ...fieldError) error {
	return &httpError{http.StatusUnprocessableEntity, errs}
}

func missing(loc ...any) fieldError {
	return fieldError{Type: "missing", Loc: loc, Msg: "Field required"}
}

func writeJSON(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(v) // a write error means the client left; nothing to do
}

// internalServerError answers as Starlette does when a handler raises an
// exception it does not turn into an HTTPException.
func internalServerError(rw http.ResponseWriter) {
	rw.Header().Set("Content-Type", "text/plain; charset=utf-8")
	rw.WriteHeader(http.StatusInternalServerError)
	io.WriteString(rw, "Internal Server Error") // a write error means the client left; nothing to do
}

// writeMedia answers v, with status 200, where v holds w.mediaToken wherever
// the base64 media b64 goes: the media is spliced into the encoded answer.
// This spares encoding/json a scan of every byte of what may be megabytes
// per output; base64 needs no escaping. The answer has a Content-Length,
// as Starlette's JSONResponse renders its body before sending it.
func (w *Worker) writeMedia(rw http.ResponseWriter, b64 string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		w.fail(rw, err)
		return
	}
	media := bytes.Count(b, []byte(w.mediaToken))
	rw.Header().Set("Content-Type", "application/json")
	rw.Header().Set("Content-Length", strconv.Itoa(len(b)+media*(len(b64)-len(w.mediaToken))))
	w.spliceMedia(rw, b, b64)
}

// spliceMedia writes b with every w.mediaToken replaced by b64.
func (w *Worker) spliceMedia(out io.Writer, b []byte, b64 string) {
	for i, part := range bytes.Split(b, []byte(w.mediaToken)) {
		if i > 0 {
			io.WriteString(out, b64) // a write error means the client left; nothing to do
		}
		out.Write(part)
	}
}

// fail answers err in FastAPI's shape. After a crash it drops the connection
// instead, as a dead process would.
func (w *Worker) fail(rw http.ResponseWriter, err error) {
	if w.crashed.Load() {
		panic(http.ErrAbortHandler)
	}
	var he *httpError
	if !errors.As(err, &he) {
		he = &httpError{http.StatusInternalServerError, err.Error()}
	}
	writeJSON(rw, he.status, map[string]any{"detail": he.detail})
}

// failGeneration answers a job of the OpenAI-style or native endpoints
// that did not complete: a scheduler error becomes the RuntimeError those
// endpoints raise unhandled, which Starlette answers 500 in plain text.
func (w *Worker) failGeneration(rw http.ResponseWriter, err error) {
	var se schedulerError
	if errors.As(err, &se) && !w.crashed.Load() {
		internalServerError(rw)
		return
	}
	w.fail(rw, err)
}

// WeightsHeader names, on the answer of an image, /v1/diffusion/generate
// or rollout job that completed, the transformer's weights the job ran
// on, as Weights names them. sglang says nothing of it: it is for tests,
// like Stats.JobsOn, which tell by it an answer stamped with one version
// that ran on other weights.
const WeightsHeader = "X-Fake-Weights"

// tell names in a job's answer the adapter and weights it ran on.
func (run jobRun) tell(rw http.ResponseWriter) {
	setAdapter(rw, run.adapter)
	rw.Header().Set(WeightsHeader, run.weights)
}

// kindErrors are pydantic's complaints about a JSON value of the wrong type,
// by the kind of Go field it was meant for.
var kindErrors = map[reflect.Kind]fieldError{
	reflect.Int:     {Type: "int_type", Msg: "Input should be a valid integer"},
	reflect.Float64: {Type: "float_type", Msg: "Input should be a valid number"},
	reflect.String:  {Type: "string_type", Msg: "Input should be a valid string"},
	reflect.Bool:    {Type: "bool_type", Msg: "Input should be a valid boolean"},
	reflect.Slice:   {Type: "list_type", Msg: "Input should be a valid list"},
}

// decodeJSON reads a JSON request body into v and reports failures as
// FastAPI's request validation does.
func decodeJSON(r *http.Request, v any) error {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return badRequest("reading body: %v", err)
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return invalid(missing("body"))
	}
	return parseJSON(body, v)
}

// parseJSON parses a JSON request body into v and reports failures as
// FastAPI's request validation does.
func parseJSON(body []byte, v any) error {
	err := json.Unmarshal(body, v)
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &typ):
		return invalid(typeError(typ))
	case errors.As(err, &syntax):
		return invalid(fieldError{Type: "json_invalid", Loc: []any{"body", syntax.Offset}, Msg: "JSON decode error"})
	}
	return invalid(fieldError{Type: "json_invalid", Loc: []any{"body"}, Msg: err.Error()})
}

func typeError(e *json.UnmarshalTypeError) fieldError {
	if e.Field == "" {
		return fieldError{Type: "model_attributes_type", Loc: []any{"body"},
			Msg: "Input should be a valid dictionary or object to extract fields from"}
	}
	fe, ok := kindErrors[e.Type.Kind()]
	if !ok {
		fe = fieldError{Type: "model_type", Msg: "Input should be a valid " + e.Type.String()}
	}
	fe.Loc = []any{"body"}
	for part := range strings.SplitSeq(e.Field, ".") {
		fe.Loc = append(fe.Loc, part)
	}
	return fe
}

// maxFormMemory is how much of a multipart body is kept in memory; the rest
// of the uploaded files spills to temporary files.
const maxFormMemory = 32 << 20

// formReader reads typed fields of a form body and collects FastAPI-style
// errors for values that do not parse.
type formReader struct {
	r    *http.Request
	errs []fieldError
}

// readForm parses a multipart or urlencoded body; any other body gives an
// empty form, so required fields are then reported missing.
func readForm(r *http.Request) (*formReader, error) {
	err := r.ParseMultipartForm(maxFormMemory)
	if err != nil && !errors.Is(err, http.ErrNotMultipart) {
		return nil, badRequest("invalid form body: %v", err)
	}
	return &formReader{r: r}, nil
}

func (f *formReader) str(name string) *string {
	if vs := f.r.PostForm[name]; len(vs) > 0 {
		return &vs[0]
	}
	return nil
}

func (f *formReader) int(name string) *int {
	return parseField(f, name, strconv.Atoi,
		"int_parsing", "Input should be a valid integer, unable to parse string as an integer")
}

func (f *formReader) float(name string) *float64 {
	return parseField(f, name, func(s string) (float64, error) { return strconv.ParseFloat(s, 64) },
		"float_parsing", "Input should be a valid number, unable to parse string as a number")
}

// hasFile reports whether a file was uploaded under any of names.
func (f *formReader) hasFile(names ...string) bool {
	if f.r.MultipartForm == nil {
		return false
	}
	for _, name := range names {
		if len(f.r.MultipartForm.File[name]) > 0 {
			return true
		}
	}
	return false
}

// err is the validation error for every field that did not parse, or nil.
func (f *formReader) err() error {
	if len(f.errs) == 0 {
		return nil
	}
	return invalid(f.errs...)
}

func parseField[T any](f *formReader, name string, parse func(string) (T, error), errType, msg string) *T {
	s := f.str(name)
	if s == nil {
		return nil
	}
	v, err := parse(*s)
	if err != nil {
		f.errs = append(f.errs, fieldError{Type: errType, Loc: []any{"body", name}, Msg: msg})
		return nil
	}
	return &v
}

// readObject reads a body the way sglang's weight endpoints do, with
// `await request.json()` and then `body.get(...)`: anything but a JSON
// object raises, and Starlette answers 500 in plain text (false is
// returned after answering).
func readObject(rw http.ResponseWriter, r *http.Request) (map[string]json.RawMessage, bool) {
	var body map[string]json.RawMessage
	b, err := io.ReadAll(r.Body)
	if err == nil {
		err = json.Unmarshal(b, &body)
	}
	if err != nil || body == nil {
		internalServerError(rw)
		return nil, false
	}
	return body, true
}

// truthy reports whether a JSON value is true in Python: present, not
// null, false, 0, "", [] or {}.
func truthy(raw json.RawMessage) bool {
	var v any
	if len(raw) == 0 || json.Unmarshal(raw, &v) != nil {
		return false
	}
	switch v := v.(type) {
	case nil:
		return false
	case bool:
		return v
	case float64:
		return v != 0
	case string:
		return v != ""
	case []any:
		return len(v) > 0
	case map[string]any:
		return len(v) > 0
	}
	return true
}

// optional is a request field whose default applies only when the field is
// absent: an explicit null is None in Python, not the default.
type optional[T any] struct {
	set   bool // the field was in the request
	value *T   // nil for null
}

func (o *optional[T]) UnmarshalJSON(b []byte) error {
	o.set = true
	return json.Unmarshal(b, &o.value)
}

// or is the field's value, def when absent, zero when null.
func (o optional[T]) or(def T) (v T, null bool) {
	switch {
	case !o.set:
		return def, false
	case o.value == nil:
		return v, true
	}
	return *o.value, false
}

// pyList formats strings as Python prints a list of them: ['a', 'b'].
func pyList(items []string) string {
	quoted := make([]string, len(items))
	for i, s := range items {
		quoted[i] = "'" + s + "'"
	}
	return "[" + strings.Join(quoted, ", ") + "]"
}

// pyFloat formats f as Python's str(float) does for ordinary values: 1.0,
// 0.5.
func pyFloat(f float64) string {
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".eEnN") {
		s += ".0"
	}
	return s
}
