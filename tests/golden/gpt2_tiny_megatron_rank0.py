# rank 0 of 4, device digits [2, 2], coordinates [0, 0]
# gpt2-tiny, B=8, S=64: size arguments are this rank's blocks; the type annotations are the captured graph's (whole tensors at the example sizes)
# what each module of the code below does (which tensor, which ranks, which direction):
# redistribute_1 = Redistribute(input_ids -> embedding: forward (8, 64)->(4, 64), sends to [], recvs from []; backward
#     none)
# all_reduce_1 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 0 of embedding)
# vocab_embedding_1 = VocabEmbedding(rows [0, 128))
# all_reduce_2 = AllReduce(mode=forward, digits=(1,), ranks=(0, 1), for=partial sums of embedding)
# all_reduce_3 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of add)
# all_reduce_4 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of layer_norm)
# all_reduce_5 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of layer_norm)
# all_reduce_6 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=gradient of input 0 of linear)
# all_reduce_7 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear)
# all_reduce_8 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear)
# all_reduce_9 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_1)
# all_reduce_10 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_1)
# all_reduce_11 = AllReduce(mode=forward, digits=(1,), ranks=(0, 1), for=partial sums of linear_1)
# all_reduce_12 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of layer_norm_1)
# all_reduce_13 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of layer_norm_1)
# all_reduce_14 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=gradient of input 0 of linear_2)
# all_reduce_15 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_2)
# all_reduce_16 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_2)
# all_reduce_17 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_3)
# all_reduce_18 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_3)
# all_reduce_19 = AllReduce(mode=forward, digits=(1,), ranks=(0, 1), for=partial sums of linear_3)
# all_reduce_20 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of layer_norm_2)
# all_reduce_21 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of layer_norm_2)
# all_reduce_22 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=gradient of input 0 of linear_4)
# all_reduce_23 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_4)
# all_reduce_24 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_4)
# all_reduce_25 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_5)
# all_reduce_26 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_5)
# all_reduce_27 = AllReduce(mode=forward, digits=(1,), ranks=(0, 1), for=partial sums of linear_5)
# all_reduce_28 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of layer_norm_3)
# all_reduce_29 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of layer_norm_3)
# all_reduce_30 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=gradient of input 0 of linear_6)
# all_reduce_31 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_6)
# all_reduce_32 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_6)
# all_reduce_33 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_7)
# all_reduce_34 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of linear_7)
# all_reduce_35 = AllReduce(mode=forward, digits=(1,), ranks=(0, 1), for=partial sums of linear_7)
# all_reduce_36 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of layer_norm_4)
# all_reduce_37 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 2 of layer_norm_4)
# all_reduce_38 = AllReduce(mode=backward, digits=(1,), ranks=(0, 1), for=gradient of input 0 of linear_8)
# all_reduce_39 = AllReduce(mode=backward, digits=(0,), ranks=(0, 2), for=gradient of input 1 of linear_8)
# redistribute_2 = Redistribute(labels -> roll: forward (8, 64)->(4, 64), sends to [], recvs from []; backward none)
# cross_entropy_1 = ShardedCrossEntropy(reduction=mean, classes from 0 over ranks (0, 1), rows over ranks (0, 2))
class PrimeParRank0(torch.nn.Module):
    def forward(self, p_embed_tokens_weight: "f32[256, 64]", p_embed_positions_weight: "f32[128, 64]", p_blocks_0_attn_norm_weight: "f32[64]", p_blocks_0_attn_norm_bias: "f32[64]", p_blocks_0_attn_qkv_proj_weight: "f32[192, 64]", p_blocks_0_attn_qkv_proj_bias: "f32[192]", p_blocks_0_attn_o_proj_weight: "f32[64, 64]", p_blocks_0_attn_o_proj_bias: "f32[64]", p_blocks_0_mlp_norm_weight: "f32[64]", p_blocks_0_mlp_norm_bias: "f32[64]", p_blocks_0_mlp_up_proj_weight: "f32[256, 64]", p_blocks_0_mlp_up_proj_bias: "f32[256]", p_blocks_0_mlp_down_proj_weight: "f32[64, 256]", p_blocks_0_mlp_down_proj_bias: "f32[64]", p_blocks_1_attn_norm_weight: "f32[64]", p_blocks_1_attn_norm_bias: "f32[64]", p_blocks_1_attn_qkv_proj_weight: "f32[192, 64]", p_blocks_1_attn_qkv_proj_bias: "f32[192]", p_blocks_1_attn_o_proj_weight: "f32[64, 64]", p_blocks_1_attn_o_proj_bias: "f32[64]", p_blocks_1_mlp_norm_weight: "f32[64]", p_blocks_1_mlp_norm_bias: "f32[64]", p_blocks_1_mlp_up_proj_weight: "f32[256, 64]", p_blocks_1_mlp_up_proj_bias: "f32[256]", p_blocks_1_mlp_down_proj_weight: "f32[64, 256]", p_blocks_1_mlp_down_proj_bias: "f32[64]", p_final_norm_weight: "f32[64]", p_final_norm_bias: "f32[64]", p_lm_head_weight: "f32[256, 64]", input_ids: "i64[8, 64]", labels: "i64[8, 64]"):
        redistribute_1 = self.redistribute_1(input_ids);  input_ids = None
        all_reduce_1 = self.all_reduce_1(p_lm_head_weight)
        vocab_embedding_1 = self.vocab_embedding_1(all_reduce_1, redistribute_1);  all_reduce_1 = redistribute_1 = None
        all_reduce_2 = self.all_reduce_2(vocab_embedding_1);  vocab_embedding_1 = None
        arange: "i64[64]" = torch.ops.aten.arange.default(64, device = device(type='meta'), pin_memory = False)
        embedding_1: "f32[64, 64]" = torch.ops.aten.embedding.default(p_embed_positions_weight, arange);  p_embed_positions_weight = arange = None
        all_reduce_3 = self.all_reduce_3(embedding_1);  embedding_1 = None
        add: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(all_reduce_2, all_reduce_3);  all_reduce_2 = all_reduce_3 = None
        all_reduce_4 = self.all_reduce_4(p_blocks_0_attn_norm_weight);  p_blocks_0_attn_norm_weight = None
        all_reduce_5 = self.all_reduce_5(p_blocks_0_attn_norm_bias);  p_blocks_0_attn_norm_bias = None
        layer_norm: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add, [64], all_reduce_4, all_reduce_5, 1e-05, False);  all_reduce_4 = all_reduce_5 = None
        all_reduce_6 = self.all_reduce_6(layer_norm);  layer_norm = None
        all_reduce_7 = self.all_reduce_7(p_blocks_0_attn_qkv_proj_weight);  p_blocks_0_attn_qkv_proj_weight = None
        all_reduce_8 = self.all_reduce_8(p_blocks_0_attn_qkv_proj_bias);  p_blocks_0_attn_qkv_proj_bias = None
        linear: "f32[8, 64, 192]" = torch.ops.aten.linear.default(all_reduce_6, all_reduce_7, all_reduce_8);  all_reduce_6 = all_reduce_7 = all_reduce_8 = None
        view: "f32[8, 64, 4, 3, 16]" = torch.ops.aten.reshape.default(linear, [4, 64, 2, 3, 16]);  linear = None
        unbind = torch.ops.aten.unbind.int(view, 3);  view = None
        getitem: "f32[8, 64, 4, 16]" = unbind[0]
        getitem_1: "f32[8, 64, 4, 16]" = unbind[1]
        getitem_2: "f32[8, 64, 4, 16]" = unbind[2];  unbind = None
        transpose: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem, 1, 2);  getitem = None
        transpose_1: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_1, 1, 2);  getitem_1 = None
        transpose_2: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_2, 1, 2);  getitem_2 = None
        scaled_dot_product_attention: "f32[8, 4, 64, 16]" = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
        transpose_3: "f32[8, 64, 4, 16]" = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
        reshape: "f32[8, 64, 64]" = torch.ops.aten.reshape.default(transpose_3, [4, 64, 32]);  transpose_3 = None
        all_reduce_9 = self.all_reduce_9(p_blocks_0_attn_o_proj_weight);  p_blocks_0_attn_o_proj_weight = None
        all_reduce_10 = self.all_reduce_10(p_blocks_0_attn_o_proj_bias);  p_blocks_0_attn_o_proj_bias = None
        linear_1: "f32[8, 64, 64]" = torch.ops.aten.linear.default(reshape, all_reduce_9);  reshape = all_reduce_9 = None
        all_reduce_11 = self.all_reduce_11(linear_1);  linear_1 = None
        add_tensor = torch.ops.aten.add.Tensor(all_reduce_11, all_reduce_10);  all_reduce_11 = all_reduce_10 = None
        add_1: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add, add_tensor);  add = add_tensor = None
        all_reduce_12 = self.all_reduce_12(p_blocks_0_mlp_norm_weight);  p_blocks_0_mlp_norm_weight = None
        all_reduce_13 = self.all_reduce_13(p_blocks_0_mlp_norm_bias);  p_blocks_0_mlp_norm_bias = None
        layer_norm_1: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_1, [64], all_reduce_12, all_reduce_13, 1e-05, False);  all_reduce_12 = all_reduce_13 = None
        all_reduce_14 = self.all_reduce_14(layer_norm_1);  layer_norm_1 = None
        all_reduce_15 = self.all_reduce_15(p_blocks_0_mlp_up_proj_weight);  p_blocks_0_mlp_up_proj_weight = None
        all_reduce_16 = self.all_reduce_16(p_blocks_0_mlp_up_proj_bias);  p_blocks_0_mlp_up_proj_bias = None
        linear_2: "f32[8, 64, 256]" = torch.ops.aten.linear.default(all_reduce_14, all_reduce_15, all_reduce_16);  all_reduce_14 = all_reduce_15 = all_reduce_16 = None
        gelu: "f32[8, 64, 256]" = torch.ops.aten.gelu.default(linear_2, approximate = 'tanh');  linear_2 = None
        all_reduce_17 = self.all_reduce_17(p_blocks_0_mlp_down_proj_weight);  p_blocks_0_mlp_down_proj_weight = None
        all_reduce_18 = self.all_reduce_18(p_blocks_0_mlp_down_proj_bias);  p_blocks_0_mlp_down_proj_bias = None
        linear_3: "f32[8, 64, 64]" = torch.ops.aten.linear.default(gelu, all_reduce_17);  gelu = all_reduce_17 = None
        all_reduce_19 = self.all_reduce_19(linear_3);  linear_3 = None
        add_tensor_1 = torch.ops.aten.add.Tensor(all_reduce_19, all_reduce_18);  all_reduce_19 = all_reduce_18 = None
        add_2: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add_1, add_tensor_1);  add_1 = add_tensor_1 = None
        all_reduce_20 = self.all_reduce_20(p_blocks_1_attn_norm_weight);  p_blocks_1_attn_norm_weight = None
        all_reduce_21 = self.all_reduce_21(p_blocks_1_attn_norm_bias);  p_blocks_1_attn_norm_bias = None
        layer_norm_2: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_2, [64], all_reduce_20, all_reduce_21, 1e-05, False);  all_reduce_20 = all_reduce_21 = None
        all_reduce_22 = self.all_reduce_22(layer_norm_2);  layer_norm_2 = None
        all_reduce_23 = self.all_reduce_23(p_blocks_1_attn_qkv_proj_weight);  p_blocks_1_attn_qkv_proj_weight = None
        all_reduce_24 = self.all_reduce_24(p_blocks_1_attn_qkv_proj_bias);  p_blocks_1_attn_qkv_proj_bias = None
        linear_4: "f32[8, 64, 192]" = torch.ops.aten.linear.default(all_reduce_22, all_reduce_23, all_reduce_24);  all_reduce_22 = all_reduce_23 = all_reduce_24 = None
        view_1: "f32[8, 64, 4, 3, 16]" = torch.ops.aten.reshape.default(linear_4, [4, 64, 2, 3, 16]);  linear_4 = None
        unbind_1 = torch.ops.aten.unbind.int(view_1, 3);  view_1 = None
        getitem_3: "f32[8, 64, 4, 16]" = unbind_1[0]
        getitem_4: "f32[8, 64, 4, 16]" = unbind_1[1]
        getitem_5: "f32[8, 64, 4, 16]" = unbind_1[2];  unbind_1 = None
        transpose_4: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_3, 1, 2);  getitem_3 = None
        transpose_5: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_4, 1, 2);  getitem_4 = None
        transpose_6: "f32[8, 4, 64, 16]" = torch.ops.aten.transpose.int(getitem_5, 1, 2);  getitem_5 = None
        scaled_dot_product_attention_1: "f32[8, 4, 64, 16]" = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
        transpose_7: "f32[8, 64, 4, 16]" = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
        reshape_1: "f32[8, 64, 64]" = torch.ops.aten.reshape.default(transpose_7, [4, 64, 32]);  transpose_7 = None
        all_reduce_25 = self.all_reduce_25(p_blocks_1_attn_o_proj_weight);  p_blocks_1_attn_o_proj_weight = None
        all_reduce_26 = self.all_reduce_26(p_blocks_1_attn_o_proj_bias);  p_blocks_1_attn_o_proj_bias = None
        linear_5: "f32[8, 64, 64]" = torch.ops.aten.linear.default(reshape_1, all_reduce_25);  reshape_1 = all_reduce_25 = None
        all_reduce_27 = self.all_reduce_27(linear_5);  linear_5 = None
        add_tensor_2 = torch.ops.aten.add.Tensor(all_reduce_27, all_reduce_26);  all_reduce_27 = all_reduce_26 = None
        add_3: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add_2, add_tensor_2);  add_2 = add_tensor_2 = None
        all_reduce_28 = self.all_reduce_28(p_blocks_1_mlp_norm_weight);  p_blocks_1_mlp_norm_weight = None
        all_reduce_29 = self.all_reduce_29(p_blocks_1_mlp_norm_bias);  p_blocks_1_mlp_norm_bias = None
        layer_norm_3: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_3, [64], all_reduce_28, all_reduce_29, 1e-05, False);  all_reduce_28 = all_reduce_29 = None
        all_reduce_30 = self.all_reduce_30(layer_norm_3);  layer_norm_3 = None
        all_reduce_31 = self.all_reduce_31(p_blocks_1_mlp_up_proj_weight);  p_blocks_1_mlp_up_proj_weight = None
        all_reduce_32 = self.all_reduce_32(p_blocks_1_mlp_up_proj_bias);  p_blocks_1_mlp_up_proj_bias = None
        linear_6: "f32[8, 64, 256]" = torch.ops.aten.linear.default(all_reduce_30, all_reduce_31, all_reduce_32);  all_reduce_30 = all_reduce_31 = all_reduce_32 = None
        gelu_1: "f32[8, 64, 256]" = torch.ops.aten.gelu.default(linear_6, approximate = 'tanh');  linear_6 = None
        all_reduce_33 = self.all_reduce_33(p_blocks_1_mlp_down_proj_weight);  p_blocks_1_mlp_down_proj_weight = None
        all_reduce_34 = self.all_reduce_34(p_blocks_1_mlp_down_proj_bias);  p_blocks_1_mlp_down_proj_bias = None
        linear_7: "f32[8, 64, 64]" = torch.ops.aten.linear.default(gelu_1, all_reduce_33);  gelu_1 = all_reduce_33 = None
        all_reduce_35 = self.all_reduce_35(linear_7);  linear_7 = None
        add_tensor_3 = torch.ops.aten.add.Tensor(all_reduce_35, all_reduce_34);  all_reduce_35 = all_reduce_34 = None
        add_4: "f32[8, 64, 64]" = torch.ops.aten.add.Tensor(add_3, add_tensor_3);  add_3 = add_tensor_3 = None
        all_reduce_36 = self.all_reduce_36(p_final_norm_weight);  p_final_norm_weight = None
        all_reduce_37 = self.all_reduce_37(p_final_norm_bias);  p_final_norm_bias = None
        layer_norm_4: "f32[8, 64, 64]" = torch.ops.aten.layer_norm.default(add_4, [64], all_reduce_36, all_reduce_37, 1e-05, False);  add_4 = all_reduce_36 = all_reduce_37 = None
        all_reduce_38 = self.all_reduce_38(layer_norm_4);  layer_norm_4 = None
        all_reduce_39 = self.all_reduce_39(p_lm_head_weight);  p_lm_head_weight = None
        linear_8: "f32[8, 64, 256]" = torch.ops.aten.linear.default(all_reduce_38, all_reduce_39);  all_reduce_38 = all_reduce_39 = None
        arange_1: "i64[64]" = torch.ops.aten.arange.default(64, device = device(type='meta'), pin_memory = False)
        eq: "b8[64]" = torch.ops.aten.eq.Scalar(arange_1, 63);  arange_1 = None
        redistribute_2 = self.redistribute_2(labels);  labels = None
        roll: "i64[8, 64]" = torch.ops.aten.roll.default(redistribute_2, [-1], [1]);  redistribute_2 = None
        masked_fill: "i64[8, 64]" = torch.ops.aten.masked_fill.Scalar(roll, eq, -100);  roll = eq = None
        reshape_2: "f32[512, 256]" = torch.ops.aten.reshape.default(linear_8, [256, 128]);  linear_8 = None
        reshape_3: "i64[512]" = torch.ops.aten.reshape.default(masked_fill, [256]);  masked_fill = None
        cross_entropy_1 = self.cross_entropy_1(reshape_2, reshape_3);  reshape_2 = reshape_3 = None
        return (cross_entropy_1,)
