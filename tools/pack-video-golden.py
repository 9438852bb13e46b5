#!/usr/bin/env python3
# Packs make-video-golden.py's output (golden.safetensors + cases.json, from the GPU machine) into
# tests/data/video/golden.bin + cases.json: pixel values as exact uint8 codes, frames once per clip.
#   python3 tools/pack-video-golden.py OUT_DIR tests/data/video
import json, struct, array, sys
src=sys.argv[1].rstrip('/')+'/'; dst=sys.argv[2].rstrip('/')+'/'
b=open(src+'golden.safetensors','rb').read(); n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); base=8+n
cases=json.load(open(src+'cases.json'))
out=bytearray(); seen={}
for c in cases['cases']:
    k=c['key']
    fr=h[k+'.frames']; assert fr['dtype']=='U8', fr['dtype']
    s,e=fr['data_offsets']; blob=b[base+s:base+e]
    if c['clip'] in seen: assert out[seen[c['clip']]:seen[c['clip']]+len(blob)]==blob; c['frames_offset']=seen[c['clip']]
    else: seen[c['clip']]=c['frames_offset']=len(out); out+=blob
    c['frames_bytes']=e-s; c['frames_shape']=fr['shape']
    px=h[k+'.pixel_values']; assert px['dtype']=='F32'
    s,e=px['data_offsets']; v=array.array('f'); v.frombytes(b[base+s:base+e])
    u=bytearray(len(v)); worst=0
    for i,x in enumerate(v):
        q=round(x*127.5+127.5); assert 0<=q<=255
        back=struct.unpack('f',struct.pack('f',(q-127.5)/127.5))[0]; worst=max(worst,abs(back-x)); u[i]=q
    assert worst<=1e-7, (k, worst)
    c['pixels_shape']=px['shape']; c['pixels_offset']=len(out); c['pixels_bytes']=len(u); out+=u
    print(k, fr['shape'], px['shape'], 'worst', worst)
cases['note']="pixels are pixel_values_videos as uint8 u with value (u - 127.5) / 127.5 (exact); frames are OpenCV's decode of the sampled frames, [n, h, w, 3]"
open(dst+'golden.bin','wb').write(out)
json.dump(cases, open(dst+'cases.json','w'), indent=1)
print(len(out))
