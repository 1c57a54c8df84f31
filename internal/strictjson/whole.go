package strictjson

import (
	"bytes"
	"errors"
	"fmt"
)

// Errors of Whole, wrapped with the offset where they were found.
var (
	// ErrIncomplete is a body that ends inside its value: cut short.
	ErrIncomplete = errors.New("JSON body ends inside a value")
	// ErrTrailing is a complete value followed by more than whitespace.
	ErrTrailing = errors.New("JSON body goes on after its value")
	// ErrStructure is a body whose brackets, commas, colons or literals
	// do not fit together.
	ErrStructure = errors.New("JSON body is not well formed")
)

// Whole reports whether body is exactly one complete JSON value, with
// whitespace around it: nil, or an error wrapping ErrIncomplete (the body
// was cut short), ErrTrailing, ErrStructure or ErrTooDeep. It is for a
// worker's answer, which the router must not call a success when it was
// cut short, not for a client's body (Scan reads those).
//
// It checks structure, not validity: brackets and braces, the commas and
// colons between them, keys being strings, true, false and null spelled
// out; it steps over strings with bytes.IndexByte and does not check their
// escapes or encoding, nor the digits of numbers. Answers are mostly
// base64 in strings, megabytes of it, so skipping a string at the speed of
// a memory scan is what makes the check cheap; json.Valid reads every byte
// through its state machine. A strict prefix of a whole object, array,
// string or literal is never whole; a top-level number cut short still
// reads as a number, which no check of the bytes alone can tell.
func Whole(body []byte) error {
	var stack []byte // the open containers, '{' or '['
	i := skipSpace(body, 0)
	for {
		// A value starts at i.
		if i >= len(body) {
			return incomplete(body)
		}
		switch c := body[i]; c {
		case '{', '[':
			closing := byte('}')
			if c == '[' {
				closing = ']'
			}
			if len(stack) >= MaxDepth { // as encoding/json counts, empty ones too
				return ErrTooDeep
			}
			i = skipSpace(body, i+1)
			if i < len(body) && body[i] == closing {
				i++
				break
			}
			stack = append(stack, c)
			if c == '{' {
				var err error
				if i, err = memberKey(body, i); err != nil {
					return err
				}
			}
			continue
		case '"':
			var err error
			if i, err = stringEnd(body, i); err != nil {
				return err
			}
		case 't', 'f', 'n':
			lit := "null"
			switch c {
			case 't':
				lit = "true"
			case 'f':
				lit = "false"
			}
			rest := body[i:min(len(body), i+len(lit))]
			switch {
			case string(rest) == lit:
				i += len(lit)
			case len(rest) < len(lit) && lit[:len(rest)] == string(rest):
				return incomplete(body)
			default:
				return fmt.Errorf("%w: bad literal at offset %d", ErrStructure, i)
			}
		default:
			start := i
			for i < len(body) && isNumberByte(body[i]) {
				i++
			}
			if i == start {
				return fmt.Errorf("%w: unexpected %q at offset %d", ErrStructure, c, i)
			}
		}
		// A value ended at i: close containers until one takes another.
	next:
		for {
			i = skipSpace(body, i)
			if len(stack) == 0 {
				if i != len(body) {
					return fmt.Errorf("%w (offset %d, %d bytes)", ErrTrailing, i, len(body)-i)
				}
				return nil
			}
			if i >= len(body) {
				return incomplete(body)
			}
			top := stack[len(stack)-1]
			switch c := body[i]; {
			case c == ',':
				i = skipSpace(body, i+1)
				if top == '{' {
					var err error
					if i, err = memberKey(body, i); err != nil {
						return err
					}
				}
				break next
			case c == '}' && top == '{', c == ']' && top == '[':
				stack = stack[:len(stack)-1]
				i++
			default:
				return fmt.Errorf("%w: unexpected %q at offset %d", ErrStructure, c, i)
			}
		}
	}
}

// memberKey reads an object member's key and its colon at i, and returns
// where the member's value starts.
func memberKey(body []byte, i int) (int, error) {
	if i >= len(body) {
		return i, incomplete(body)
	}
	if body[i] != '"' {
		return i, fmt.Errorf("%w: a key must be a string, offset %d", ErrStructure, i)
	}
	i, err := stringEnd(body, i)
	if err != nil {
		return i, err
	}
	i = skipSpace(body, i)
	switch {
	case i >= len(body):
		return i, incomplete(body)
	case body[i] != ':':
		return i, fmt.Errorf("%w: no colon after a key, offset %d", ErrStructure, i)
	}
	return skipSpace(body, i+1), nil
}

// stringEnd returns the offset just past the string whose opening quote is
// at i. A quote preceded by an odd run of backslashes is escaped; the runs
// between quotes are disjoint, so counting them costs O(len) in all.
func stringEnd(body []byte, i int) (int, error) {
	j := i + 1
	for {
		k := bytes.IndexByte(body[j:], '"')
		if k < 0 {
			return len(body), incomplete(body)
		}
		j += k
		escapes := 0
		for p := j - 1; p > i && body[p] == '\\'; p-- {
			escapes++
		}
		if escapes%2 == 0 {
			return j + 1, nil
		}
		j++
	}
}

func skipSpace(body []byte, i int) int {
	for i < len(body) && (body[i] == ' ' || body[i] == '\n' || body[i] == '\r' || body[i] == '\t') {
		i++
	}
	return i
}

func isNumberByte(c byte) bool {
	return '0' <= c && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'
}

func incomplete(body []byte) error {
	return fmt.Errorf("%w (offset %d)", ErrIncomplete, len(body))
}
