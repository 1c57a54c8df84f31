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

// Errors of jobs that do not complete.
var (
	errAsleep   = &httpError{http.StatusServiceUnavailable, "memory occupation is released (sleeping): call /resume_memory_occupation first"}
	errInjected = &httpError{http.StatusInternalServerError, "Generation failed: injected failure (fail rate)"}
	errClosed   = &httpError{http.StatusServiceUnavailable, "worker is shutting down"}
	errCrashed  = &httpError{http.StatusServiceUnavailable, "worker crashed"}
)

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

// writeVersioned answers a generation result, whose body names the weight
// version, and repeats the version in a header for routers that do not parse
// bodies.
func writeVersioned(rw http.ResponseWriter, version string, v any) {
	rw.Header().Set("X-Weight-Version", version)
	writeJSON(rw, http.StatusOK, v)
}

// writeMedia is writeVersioned for answers that carry the fake media: v
// holds w.mediaToken wherever the base64 media goes, and the media is spliced
// into the encoded answer. This spares encoding/json a scan of every byte of
// what may be megabytes per output; base64 needs no escaping.
func (w *Worker) writeMedia(rw http.ResponseWriter, version string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		w.fail(rw, err)
		return
	}
	rw.Header().Set("Content-Type", "application/json")
	rw.Header().Set("X-Weight-Version", version)
	for i, part := range bytes.Split(b, []byte(w.mediaToken)) {
		if i > 0 {
			io.WriteString(rw, w.outputB64) // a write error means the client left; nothing to do
		}
		rw.Write(part)
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
	err = json.Unmarshal(body, v)
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
