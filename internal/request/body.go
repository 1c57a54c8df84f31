package request

import (
	"errors"
	"net/http"
)

// OverMaxBody reports whether err ended the read of a body that was
// longer than its bound (max_body).
func OverMaxBody(err error) bool {
	_, ok := errors.AsType[*http.MaxBytesError](err)
	return ok
}
