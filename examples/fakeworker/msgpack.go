package fakeworker

import (
	"encoding/binary"
	"fmt"
	"math"
)

// mpEntry is one key/value pair of a MessagePack map.
type mpEntry struct {
	key string
	val any
}

// mpMap is a MessagePack map whose keys keep their order, as msgspec keeps
// those of a Python dict.
type mpMap []mpEntry

// appendMsgpack appends v in MessagePack form. It knows only the types the
// rollout answer uses: nil, bool, int, float64, string, []any and mpMap.
func appendMsgpack(b []byte, v any) []byte {
	switch v := v.(type) {
	case nil:
		return append(b, 0xc0)
	case bool:
		if v {
			return append(b, 0xc3)
		}
		return append(b, 0xc2)
	case int:
		return appendMsgpackInt(b, int64(v))
	case float64:
		return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(v))
	case string:
		b = appendMsgpackLen(b, len(v), 0xa0, 32, 0xd9, 0xda, 0xdb)
		return append(b, v...)
	case []any:
		b = appendMsgpackLen(b, len(v), 0x90, 16, 0, 0xdc, 0xdd)
		for _, e := range v {
			b = appendMsgpack(b, e)
		}
		return b
	case mpMap:
		b = appendMsgpackLen(b, len(v), 0x80, 16, 0, 0xde, 0xdf)
		for _, e := range v {
			b = appendMsgpack(appendMsgpack(b, e.key), e.val)
		}
		return b
	}
	panic(fmt.Sprintf("msgpack: unsupported type %T", v))
}

// appendMsgpackLen appends the header of a string, array or map of n items:
// the fix form (fix|n) when n < fixLimit, else the smallest of the 8-, 16-
// and 32-bit forms. code8 is 0 for types without an 8-bit form.
func appendMsgpackLen(b []byte, n int, fix byte, fixLimit int, code8, code16, code32 byte) []byte {
	switch {
	case n < fixLimit:
		return append(b, fix|byte(n))
	case code8 != 0 && n <= math.MaxUint8:
		return append(b, code8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, code16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, code32), uint32(n))
}

// appendMsgpackInt appends n in its shortest form, unsigned when n >= 0 as
// msgspec writes it.
func appendMsgpackInt(b []byte, n int64) []byte {
	switch {
	case n >= -32 && n <= math.MaxInt8: // positive and negative fixint
		return append(b, byte(n))
	case n > 0 && n <= math.MaxUint8:
		return append(b, 0xcc, byte(n))
	case n > 0 && n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(n))
	case n > 0 && n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(n))
	case n > 0:
		return binary.BigEndian.AppendUint64(append(b, 0xcf), uint64(n))
	case n >= math.MinInt8:
		return append(b, 0xd0, byte(n))
	case n >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(n))
	case n >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(n))
}
