package fakeworker

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"strings"
	"testing"
)

func TestAppendMsgpack(t *testing.T) {
	str := func(n int) string { return strings.Repeat("a", n) }
	hexStr := func(n int) string { return strings.Repeat("61", n) }
	tests := []struct {
		v    any
		want string
	}{
		{nil, "c0"},
		{true, "c3"},
		{false, "c2"},
		{0, "00"},
		{127, "7f"},
		{128, "cc80"},
		{255, "ccff"},
		{256, "cd0100"},
		{65536, "ce00010000"},
		{1 << 32, "cf0000000100000000"},
		{-1, "ff"},
		{-32, "e0"},
		{-33, "d0df"},
		{-129, "d1ff7f"},
		{-32769, "d2ffff7fff"},
		{math.MinInt64, "d38000000000000000"},
		{1.5, "cb3ff8000000000000"},
		{"", "a0"},
		{str(31), "bf" + hexStr(31)},
		{str(32), "d920" + hexStr(32)},
		{str(256), "da0100" + hexStr(256)},
		{[]any{}, "90"},
		{[]any{1, "a"}, "9201a161"},
		{make([]any, 16), "dc0010" + strings.Repeat("c0", 16)},
		{mpMap{{"a", 1}}, "81a16101"},
		{mpMap{{"k", mpMap{}}}, "81a16b80"},
	}
	for _, tt := range tests {
		got := hex.EncodeToString(appendMsgpack(nil, tt.v))
		if got != tt.want {
			t.Errorf("appendMsgpack(%#v) = %s, want %s", tt.v, got, tt.want)
		}
	}
}

func TestAppendMsgpackLargeMap(t *testing.T) {
	m := make(mpMap, 16)
	for i := range m {
		m[i] = mpEntry{fmt.Sprint(i), i}
	}
	got, err := decodeMsgpack(appendMsgpack(nil, m))
	if err != nil {
		t.Fatal(err)
	}
	if dm := got.(map[string]any); len(dm) != 16 || dm["15"] != int64(15) {
		t.Errorf("decoded %v", dm)
	}
}

// decodeMsgpack decodes the subset of MessagePack that appendMsgpack writes,
// independently of it; ints come back as int64, maps as map[string]any.
func decodeMsgpack(b []byte) (any, error) {
	d := &mpDecoder{b: b}
	v := d.value()
	if d.err == nil && d.pos != len(b) {
		d.err = fmt.Errorf("%d trailing bytes", len(b)-d.pos)
	}
	return v, d.err
}

type mpDecoder struct {
	b   []byte
	pos int
	err error
}

func (d *mpDecoder) next(n int) []byte {
	if d.err != nil || d.pos+n > len(d.b) {
		d.err = fmt.Errorf("truncated at %d", d.pos)
		return make([]byte, n)
	}
	d.pos += n
	return d.b[d.pos-n : d.pos]
}

func (d *mpDecoder) uint(n int) int64 {
	var v uint64
	for _, c := range d.next(n) {
		v = v<<8 | uint64(c)
	}
	return int64(v)
}

func (d *mpDecoder) value() any {
	c := d.next(1)[0]
	switch {
	case c <= 0x7f:
		return int64(c)
	case c >= 0xe0:
		return int64(int8(c))
	case c&0xe0 == 0xa0:
		return string(d.next(int(c & 0x1f)))
	case c&0xf0 == 0x90:
		return d.array(int(c & 0x0f))
	case c&0xf0 == 0x80:
		return d.mapping(int(c & 0x0f))
	}
	switch c {
	case 0xc0:
		return nil
	case 0xc2, 0xc3:
		return c == 0xc3
	case 0xcb:
		return math.Float64frombits(binary.BigEndian.Uint64(d.next(8)))
	case 0xcc, 0xcd, 0xce, 0xcf:
		return d.uint(1 << (c - 0xcc))
	case 0xd0:
		return int64(int8(d.next(1)[0]))
	case 0xd1:
		return int64(int16(binary.BigEndian.Uint16(d.next(2))))
	case 0xd2:
		return int64(int32(binary.BigEndian.Uint32(d.next(4))))
	case 0xd3:
		return int64(binary.BigEndian.Uint64(d.next(8)))
	case 0xd9, 0xda, 0xdb:
		return string(d.next(int(d.uint(1 << (c - 0xd9)))))
	case 0xdc, 0xdd:
		return d.array(int(d.uint(2 << (c - 0xdc))))
	case 0xde, 0xdf:
		return d.mapping(int(d.uint(2 << (c - 0xde))))
	}
	d.err = fmt.Errorf("unexpected byte %#x at %d", c, d.pos-1)
	return nil
}

func (d *mpDecoder) array(n int) []any {
	a := make([]any, 0, n)
	for range n {
		a = append(a, d.value())
	}
	return a
}

func (d *mpDecoder) mapping(n int) map[string]any {
	m := make(map[string]any, n)
	for range n {
		k, _ := d.value().(string)
		m[k] = d.value()
	}
	return m
}
