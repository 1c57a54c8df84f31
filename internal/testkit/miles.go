package testkit

import (
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// Miles posts as miles' http_utils does: any error, an error status
// included, is retried, 1 s apart, up to 60 times. The zero value is
// ready.
type Miles struct {
	Client  http.Client
	retries atomic.Int64 // attempts after a first one, over every call
}

// Retries counts the attempts made after a first one, over every call.
func (m *Miles) Retries() int64 { return m.retries.Load() }

// Post sends body to url until it is answered 200, and returns that
// answer, or the last one after 60 attempts: status 0 and the error's
// text when it was no answer at all.
func (m *Miles) Post(url, body string) (status int, header http.Header, text string) {
	for attempt := 1; ; attempt++ {
		status, header, text = m.try(url, body)
		if status == http.StatusOK || attempt == 60 {
			return status, header, text
		}
		m.retries.Add(1)
		time.Sleep(time.Second)
	}
}

func (m *Miles) try(url, body string) (int, http.Header, string) {
	resp, err := m.Client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, nil, err.Error()
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, resp.Header, err.Error()
	}
	return resp.StatusCode, resp.Header, string(data)
}
